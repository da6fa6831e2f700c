package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox"
)

func init() {
	register(benchCase{name: "write", usage: "delete throughput without and with the writer hook, side by side",
		flags: func(fs *flag.FlagSet) runner {
			o := writeOpts{writers: 16, events: 20000, projects: 16, mailbox: mailboxExcluded, notify: true}
			fs.IntVar(&o.writers, "writers", o.writers, "concurrent writers")
			fs.IntVar(&o.events, "events", o.events, "deletes per side")
			fs.IntVar(&o.projects, "projects", o.projects, "projects the deletes spread over")
			fs.BoolVar(&o.notify, "notify", o.notify, "the writer hook sends its post-commit wake-up (false separates the insert's cost from the NOTIFY's)")
			fs.StringVar(&o.mailbox, "mailbox", o.mailbox, `"excluded": the post-commit mailbox notice commits nothing on either side; "included": as the host writes it`)
			fs.IntVar(&o.grants, "grants", o.grants, "grant the writer role this many projects one by one (the deletes' among them) instead of every project ('*'); 0: '*'")
			return one(func(ctx context.Context, env *Env) (writeResult, error) { return runWrite(ctx, env, o) })
		}})
}

const (
	mailboxExcluded = "excluded"
	mailboxIncluded = "included"
)

type writeOpts struct {
	writers, events, projects int
	mailbox                   string
	notify                    bool
	grants                    int // projects granted to the writer role one by one; 0: '*'
}

// WriteSide is one side of the write case.
type WriteSide struct {
	Tx      int64   `json:"tx"`
	Errors  int64   `json:"errors"`
	Seconds float64 `json:"seconds"`
	TxPerS  float64 `json:"tx_per_s"`
	P50     float64 `json:"p50_ms"`
	P99     float64 `json:"p99_ms"`
	Max     float64 `json:"max_ms"`
	// The delete transaction alone (BEGIN sent to COMMIT returned), without the host's
	// post-commit work that the figures above include.
	TxOnlyP50 float64 `json:"tx_only_p50_ms"`
	TxOnlyP99 float64 `json:"tx_only_p99_ms"`
	// StatementsPerTx counts every statement the side's pool sent per delete (BEGIN and COMMIT
	// included); Notifies are the writer hook's wake-ups among them.
	StatementsPerTx float64 `json:"statements_per_tx"`
	// RoundTripsPerTx counts a batch of statements as one.
	RoundTripsPerTx float64 `json:"round_trips_per_tx"`
	Notifies        int64   `json:"notifies"`
	// CPU per delete: the bench process (writers, driver, hook) and the server's processes
	// (0 when the server does not run on this machine).
	ClientCPUPerTx float64 `json:"client_cpu_us_per_tx"`
	ServerCPUPerTx float64 `json:"server_cpu_us_per_tx"`
}

type writeResult struct {
	Header
	Writers  int    `json:"writers"`
	Projects int    `json:"projects"`
	Events   int    `json:"events"`
	Mailbox  string `json:"mailbox"`
	Notify   bool   `json:"notify"`
	// WriterGrants is what the writer role is granted: "*" (every project) or how many
	// projects, one by one, as a project-scoped role is.
	WriterGrants     string    `json:"writer_grants"`
	Baseline         WriteSide `json:"baseline"`
	Outbox           WriteSide `json:"outbox"`
	OutboxVsBaseline float64   `json:"outbox_vs_baseline"`
}

// skipMailboxSQL makes the host's mailbox insert a no-op: the statement still runs, but the
// row is dropped before it is written, so the notice's own transaction commits nothing and
// waits for no WAL flush.
const skipMailboxSQL = `
CREATE FUNCTION bench_skip_mailbox() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;
CREATE TRIGGER bench_skip_mailbox BEFORE INSERT ON mailbox_notices FOR EACH ROW EXECUTE FUNCTION bench_skip_mailbox();`

// runWrite measures Store.Delete on two fresh databases, one without and one with the writer
// hook (runABBA interleaves them).
func runWrite(ctx context.Context, env *Env, o writeOpts) (writeResult, error) {
	res := writeResult{Header: env.Header("write"), Writers: o.writers, Projects: o.projects, Events: o.events, Mailbox: o.mailbox, Notify: o.notify,
		WriterGrants: "*"}
	if o.writers < 1 || o.events < 2 || o.projects < 1 || o.grants < 0 || (o.grants > 0 && o.grants < o.projects) {
		return res, fmt.Errorf("write: need writers >= 1, events >= 2, projects >= 1, and grants 0 or at least projects")
	}
	if o.grants > 0 {
		res.WriterGrants = strconv.Itoa(o.grants)
	}
	if o.mailbox != mailboxExcluded && o.mailbox != mailboxIncluded {
		return res, fmt.Errorf("write: -mailbox must be %q or %q", mailboxExcluded, mailboxIncluded)
	}
	host := func(withOutbox bool) sideSetup {
		return func(ctx context.Context, admin, pool *pgxpool.Pool) (deleteFunc, func(), error) {
			if o.grants > 0 {
				if err := grantOneByOne(ctx, admin, pool, o.projects, o.grants); err != nil {
					return nil, nil, err
				}
			}
			if o.mailbox == mailboxExcluded {
				if _, err := admin.Exec(ctx, skipMailboxSQL); err != nil {
					return nil, nil, fmt.Errorf("exclude mailbox: %w", err)
				}
			}
			store, w, err := newHost(pool, withOutbox, o.notify)
			if err != nil {
				return nil, nil, err
			}
			if w == nil {
				return hostDelete(store), nil, nil
			}
			return hostDelete(store), closeWriter(w), nil
		}
	}
	base, err := newSide(ctx, env, "write_baseline", o.writers, o.events, o.projects, host(false))
	if err != nil {
		return res, err
	}
	defer base.Close()
	withOutbox, err := newSide(ctx, env, "write_outbox", o.writers, o.events, o.projects, host(true))
	if err != nil {
		return res, err
	}
	defer withOutbox.Close()
	if err := runABBA(ctx, env, o.writers, base, withOutbox); err != nil {
		return res, err
	}
	res.Baseline, res.Outbox = base.summary(), withOutbox.summary()
	res.OutboxVsBaseline = ratio(res.Outbox.TxPerS, res.Baseline.TxPerS)
	return res, nil
}

// grantOneByOne takes '*' from pool's role and grants it n projects instead: the deletes'
// projects and others up to n.
func grantOneByOne(ctx context.Context, admin, pool *pgxpool.Pool, projects, n int) error {
	var role string
	if err := pool.QueryRow(ctx, "SELECT current_user").Scan(&role); err != nil {
		return fmt.Errorf("writer role: %w", err)
	}
	names := make([]string, n)
	for i := range names {
		names[i] = projectName(i)
		if i >= projects {
			names[i] = fmt.Sprintf("granted-%05d", i)
		}
	}
	if err := outbox.GrantProjectAccess(ctx, admin, role, names...); err != nil {
		return fmt.Errorf("grant %d projects: %w", n, err)
	}
	if err := outbox.RevokeProjectAccess(ctx, admin, role, "*"); err != nil {
		return fmt.Errorf("revoke every project: %w", err)
	}
	return nil
}

func ratio(a, b float64) float64 {
	if b <= 0 {
		return 0
	}
	return round3(a / b)
}
