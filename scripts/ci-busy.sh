#!/usr/bin/env bash
# ci-busy: repeat the proof that a first `make test` is green on a busy machine.
#
# Clones the current HEAD into a fresh temporary directory RUNS times and runs the CI entry
# point (CI=true bash .ci/run) in each clone, one after the other. During the first BUSY_RUNS
# runs, BURNERS processes spin on the CPU beside it, as other work does on a shared machine.
# Prints each run's result and duration, keeps each run's log, and exits non-zero if any run
# failed.
#
#   scripts/ci-busy.sh                 # 5 runs, the first 3 beside 2 CPU burners
#   RUNS=1 BURNERS=0 scripts/ci-busy.sh
#   DRY_RUN=1 scripts/ci-busy.sh       # say what would run, run nothing
#   CI_CMD=true RUNS=2 scripts/ci-busy.sh  # check the script itself: run CI_CMD, not .ci/run
#
# Nothing in the tests reads outside the clone (no ../shared), so a bare clone is enough. The
# clones are removed after their run; the logs stay in LOG_DIR.
set -euo pipefail

RUNS=${RUNS:-5}
BURNERS=${BURNERS:-2}
BUSY_RUNS=${BUSY_RUNS:-3}
DRY_RUN=${DRY_RUN:-}
CI_CMD=${CI_CMD:-bash .ci/run}
for v in RUNS BURNERS BUSY_RUNS; do
	[[ ${!v} =~ ^[0-9]+$ ]] || { echo "ci-busy: $v must be a whole number, not '${!v}'" >&2; exit 2; }
done

src=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
sha=$(git -C "$src" rev-parse HEAD)
LOG_DIR=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/ci-busy-logs.XXXXXX")}
mkdir -p "$LOG_DIR"

burner_pids=()
start_burners() {
	for _ in $(seq 1 "$BURNERS"); do
		sh -c 'while :; do :; done' &
		burner_pids+=("$!")
	done
	[[ $BURNERS -eq 0 ]] || echo "ci-busy: $BURNERS CPU burner(s) running: ${burner_pids[*]}"
}
stop_burners() {
	# Only the processes this script started, by their IDs.
	if [[ ${#burner_pids[@]} -gt 0 ]]; then
		kill "${burner_pids[@]}" 2>/dev/null || true
		wait "${burner_pids[@]}" 2>/dev/null || true
		echo "ci-busy: burners stopped"
	fi
	burner_pids=()
}
clone_dir=
ci_pid=
cleanup() {
	stop_burners
	if [[ -n $ci_pid ]]; then
		# The run is in a process group of its own (setsid): end it and what it started.
		kill -TERM -- "-$ci_pid" 2>/dev/null || true
		wait "$ci_pid" 2>/dev/null || true
	fi
	[[ -z $clone_dir ]] || rm -rf "$clone_dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "ci-busy: $RUNS run(s) of CI=true $CI_CMD at ${sha:0:12}; $BURNERS burner(s) during the first $BUSY_RUNS; logs in $LOG_DIR"
if [[ -n $DRY_RUN ]]; then
	for i in $(seq 1 "$RUNS"); do
		busy=idle
		[[ $i -le $BUSY_RUNS && $BURNERS -gt 0 ]] && busy="beside $BURNERS burner(s)"
		echo "ci-busy: would clone $src at ${sha:0:12} into a fresh temporary directory and run CI=true $CI_CMD ($busy), log $LOG_DIR/run-$i.log"
	done
	exit 0
fi

failed=0
results=()
for i in $(seq 1 "$RUNS"); do
	if [[ $i -le $BUSY_RUNS && ${#burner_pids[@]} -eq 0 ]]; then
		start_burners
	elif [[ $i -gt $BUSY_RUNS ]]; then
		stop_burners
	fi
	clone_dir=$(mktemp -d "${TMPDIR:-/tmp}/ci-busy-run.XXXXXX")
	git clone --quiet --no-checkout "$src" "$clone_dir/outbox"
	git -C "$clone_dir/outbox" checkout --quiet --detach "$sha"
	log="$LOG_DIR/run-$i.log"
	busy=$([[ ${#burner_pids[@]} -gt 0 ]] && echo "busy" || echo "idle")
	echo "ci-busy: run $i/$RUNS ($busy) in $clone_dir/outbox"
	start=$(date +%s)
	# In the background and waited for, so that an interrupt reaches the trap at once.
	(cd "$clone_dir/outbox" && CI=true exec setsid bash -c "$CI_CMD") >"$log" 2>&1 &
	ci_pid=$!
	if wait "$ci_pid"; then
		result=PASS
	else
		result=FAIL
		failed=$((failed + 1))
	fi
	ci_pid=
	secs=$(($(date +%s) - start))
	results+=("run $i ($busy): $result in ${secs}s")
	echo "ci-busy: run $i ($busy): $result in ${secs}s, log $log"
	if [[ $result == FAIL ]]; then
		grep -E -- '^(--- FAIL|FAIL|panic:)' "$log" | head -20 | sed 's/^/ci-busy:   /' || true
	fi
	rm -rf "$clone_dir"
	clone_dir=
done
stop_burners

echo "ci-busy: summary"
printf 'ci-busy:   %s\n' "${results[@]}"
if [[ $failed -gt 0 ]]; then
	echo "ci-busy: $failed of $RUNS run(s) failed"
	exit 1
fi
echo "ci-busy: all $RUNS run(s) passed"
