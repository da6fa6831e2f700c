# The two commands a newcomer needs: `make demo` (the main job) and `make test`.
SHELL := /bin/bash
export PATH := /usr/local/go/bin:$(PATH)
# The toolchain every target builds and tests with. It fixes the standard library's known
# advisories that the machine's own go1.26.8 carries (docs/operations.md, "Dependencies and
# known vulnerabilities"); the go command fetches it once from the module proxy.
export GOTOOLCHAIN := go1.27.3
GO ?= go
# staticcheck must be built by the toolchain whose standard library it reads.
GOBIN := $(shell $(GO) env GOPATH)/bin/$(GOTOOLCHAIN)
STATICCHECK := $(GOBIN)/staticcheck
STATICCHECK_VERSION := v0.8.2

.PHONY: test demo bench soak fuzz lint deps postgres pgbouncer chromium staticcheck ci-busy schema

test: deps lint
	CI=$${CI:-false} $(GO) test -race -count=1 -timeout 25m ./...

# schema.sql, the module's whole current schema for reviewers, rewritten from a throwaway database
# migrated from empty (internal/schemadump). `make test` fails while the committed file differs.
schema: postgres
	CI=true $(GO) test -count=1 -run '^TestSchemaSQLIsCurrent$$' ./internal/schemadump -update

demo: postgres
	$(GO) run ./cmd/outbox-demo $(DEMO_FLAGS)

# The JSON lines go to BENCH_OUT (and the terminal), then the scale curves, drains and sustained
# runs are drawn beside them as a PNG. BENCH_FLAGS go to the all case (e.g. -quick).
BENCH_OUT ?= bench/results.jsonl
BENCH_CHART ?= $(dir $(BENCH_OUT))scale.png
# go run stamps no VCS revision, so the commit the lines were measured at is passed in.
BENCH_COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null)$(shell git diff --quiet HEAD 2>/dev/null || echo -dirty)
bench: postgres
	@mkdir -p $(dir $(BENCH_OUT))
	set -o pipefail; $(GO) run -ldflags "-X main.buildCommit=$(BENCH_COMMIT)" ./cmd/outbox-bench all $(BENCH_FLAGS) | tee $(BENCH_OUT)
	$(GO) run ./cmd/outbox-bench chart -in $(BENCH_OUT) -out $(BENCH_CHART)

soak: postgres
	OUTBOX_SOAK=10m $(GO) test -race -count=1 -timeout 30m -run TestFaultSuite -v ./internal/faultsuite

# The CI run from fresh clones of HEAD, the first ones beside CPU burners (scripts/ci-busy.sh:
# RUNS, BURNERS, BUSY_RUNS, DRY_RUN). It takes the machine for a long while.
ci-busy:
	bash scripts/ci-busy.sh

# Each fuzz target for FUZZTIME (default 1m); `make test` already runs their seed corpora.
FUZZTIME ?= 1m
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzParseConsumerID$$' -fuzztime $(FUZZTIME) .
	$(GO) test -run '^$$' -fuzz '^FuzzConfigValidate$$' -fuzztime $(FUZZTIME) .
	$(GO) test -run '^$$' -fuzz '^FuzzParseEventID$$' -fuzztime $(FUZZTIME) .
	$(GO) test -run '^$$' -fuzz '^FuzzParseWakePayload$$' -fuzztime $(FUZZTIME) .
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeEvent$$' -fuzztime $(FUZZTIME) .
	$(GO) test -run '^$$' -fuzz '^FuzzParseStreamID$$' -fuzztime $(FUZZTIME) ./web
	$(GO) test -run '^$$' -fuzz '^FuzzStreamReader$$' -fuzztime $(FUZZTIME) ./web

lint: staticcheck
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	  if [ -n "$$unformatted" ]; then echo "gofmt would change: $$unformatted"; exit 1; fi
	$(GO) vet ./...
	$(STATICCHECK) ./...

deps: postgres pgbouncer chromium staticcheck

staticcheck:
	@[ -x $(STATICCHECK) ] || GOBIN=$(GOBIN) $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

# The tests, the demo and the benchmarks start their own throwaway PostgreSQL from the
# installed server binaries; install them when they are missing.
postgres:
	@if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "installing the PostgreSQL server binaries"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null; \
	else \
	  echo "the PostgreSQL server binaries are missing: sudo apt-get install postgresql (or set TEST_DATABASE_URL)"; exit 1; \
	fi

# The browser tests drive Debian's Chromium headless (with CI=true they fail rather than skip
# without it); install it when it is missing.
chromium:
	@if [ -x /usr/bin/chromium ] || [ -n "$$CHROMIUM" ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "installing Chromium for the browser tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	else \
	  echo "Chromium is missing: sudo apt-get install chromium (or set CHROMIUM to a Chrome binary)"; exit 1; \
	fi

# The PgBouncer tests start their own throwaway bouncer in front of the throwaway cluster
# (internal/pgbouncer); install the binary when it is missing. Debian's package would start a
# system-wide bouncer: a policy-rc.d that refuses service starts keeps it from doing so, and
# any that started anyway is stopped, so nothing is left running.
pgbouncer:
	@if command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "installing PgBouncer"; \
	  made_policy=; if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends pgbouncer >/dev/null; status=$$?; \
	  [ -n "$$made_policy" ] && rm -f /usr/sbin/policy-rc.d; \
	  if [ -x /etc/init.d/pgbouncer ]; then /etc/init.d/pgbouncer stop >/dev/null 2>&1 || true; fi; \
	  exit $$status; \
	else \
	  echo "PgBouncer is missing: sudo apt-get install pgbouncer"; exit 1; \
	fi
