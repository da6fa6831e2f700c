package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"fusion/outbox"
)

func statusCommand(a *app) *cobra.Command {
	var sortBy, readDSN string
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show each consumer's cursor, lag, lease and open deliveries",
		Long: `status shows one row per (project, consumer) cursor:

  CURSOR        the last acknowledged sequence ("-": never positioned yet)
  HEAD          the project's last sequenced event
  LAG_EVENTS    HEAD - CURSOR: events the consumer has not acknowledged
  LAG_SECONDS   age of the oldest unacknowledged event (0 when caught up)
  LEASE_HOLDER  the process instance holding the lease ("(expired)" when it lapsed)
  LEASE_EXPIRES when the lease runs out unless renewed (database clock, UTC)
  RETIRED       whether an operator retired this identity here
  RETRYING      events waiting for their next attempt
  DEAD          dead letters; REPLAYING: dead letters waiting for a requested replay

A summary line follows the table:

  N consumers, B behind (worst lag E events, S seconds), D dead letters, R replaying

  consumers     the rows shown
  behind        rows with LAG_EVENTS above 0
  worst lag     the largest LAG_EVENTS and the largest LAG_SECONDS (each over all rows;
                they may belong to different consumers)
  dead letters  the sum of DEAD; replaying: the sum of REPLAYING

Rows are ordered by project, then consumer; --sort lag puts the consumers furthest behind
first (LAG_EVENTS, then LAG_SECONDS, descending). --json applies the same order and has no
summary line.

--project and --consumer narrow the list; an unknown --consumer is an error.

--read-dsn names a hot standby that consumers read from (their read_dsn): a last line says how
far it is behind the primary, in ticks and in seconds (the primary's newest tick time minus the
standby's), or that it has caught up. It is not shown with --json.`,
		Example: `  outboxctl status
  outboxctl status --sort lag
  outboxctl status --project alpha --consumer dashboard
  outboxctl status --json | jq '.[] | select(.lagEvents > 1000)'
  outboxctl status --read-dsn "host=replica-1 dbname=tasks user=oncall"`,
		Args: cobra.NoArgs,
		RunE: a.action(func(ctx context.Context, cmd *cobra.Command, args []string) error {
			return a.runStatus(ctx, cmd, sortBy, readDSN)
		}),
	}
	cmd.Flags().StringVar(&sortBy, "sort", sortName, "row order: name (project, then consumer) or lag (furthest behind first)")
	cmd.Flags().StringVar(&readDSN, "read-dsn", "", "a hot standby consumers read from: show how far it is behind the primary")
	return cmd
}

// Orders of status rows.
const (
	sortName = "name"
	sortLag  = "lag"
)

func (a *app) runStatus(ctx context.Context, cmd *cobra.Command, sortBy, readDSN string) error {
	if sortBy != sortName && sortBy != sortLag {
		return usageErrorf("--sort must be %q or %q (got %q)", sortName, sortLag, sortBy)
	}
	var standby *pgxpool.Config
	if readDSN != "" {
		if a.json {
			return usageErrorf("--read-dsn adds a line under the table: it is not shown with --json")
		}
		var err error
		if standby, err = pgxpool.ParseConfig(readDSN); err != nil {
			return usageErrorf("--read-dsn does not parse (%s)", parseReason(err)) // never repeated: it may hold a password
		}
	}
	if err := a.checkFilters(cmd, false, false, true, true); err != nil {
		return err
	}
	ctx, cancel := a.phase(ctx)
	defer cancel()
	if err := a.open(ctx); err != nil {
		return err
	}
	rows, err := a.admin().Status(ctx, a.filter())
	// Projects whose rows cannot be read are left out and named; the others are shown, and the
	// command still fails so that a script sees the status is incomplete.
	var partial *outbox.ProjectErrors
	if err != nil && !errors.As(err, &partial) {
		return err
	}
	if len(rows) == 0 && a.consumer != "" && partial == nil {
		return a.unknownConsumer()
	}
	if sortBy == sortLag {
		// Stable, so that equal lags keep the project, consumer order.
		slices.SortStableFunc(rows, func(x, y outbox.ConsumerStatus) int {
			if c := cmp.Compare(y.LagEvents, x.LagEvents); c != 0 {
				return c
			}
			return cmp.Compare(y.LagSeconds, x.LagSeconds)
		})
	}
	if a.json {
		if err := a.printJSON(nonNil(rows)); err != nil {
			return err
		}
		return partialError(partial)
	}
	if len(rows) == 0 {
		a.note("no consumer cursors match")
		return partialError(partial)
	}
	t := newTable(a.stdout, "PROJECT", "CONSUMER", "CURSOR", "HEAD", "LAG_EVENTS", "LAG_SECONDS",
		"LEASE_HOLDER", "LEASE_EXPIRES", "RETIRED", "RETRYING", "DEAD", "REPLAYING")
	for _, r := range rows {
		holder := orDash(r.LeaseOwner)
		if r.LeaseOwner != "" && !r.LeaseHeld {
			holder += " (expired)"
		}
		t.row(r.ProjectID, r.ConsumerID, cursorText(r.Cursor), itoa(r.Head), itoa(r.LagEvents),
			strconv.FormatFloat(r.LagSeconds, 'f', 1, 64), holder, timeText(r.LeaseExpiresAt),
			yesNo(r.Retired), itoa(r.Retrying), itoa(r.Dead), itoa(r.ReplayRequested))
	}
	if err := t.flush(); err != nil {
		return err
	}
	if _, err := fmt.Fprintf(a.stdout, "\n%s\n", statusSummary(rows)); err != nil {
		return fmt.Errorf("write summary: %w", err)
	}
	if standby != nil {
		line, err := a.standbyLine(ctx, standby)
		if err != nil {
			return err
		}
		if _, err := fmt.Fprintln(a.stdout, line); err != nil {
			return fmt.Errorf("write standby line: %w", err)
		}
	}
	return partialError(partial)
}

// standbyLine says how far the standby consumers read from is behind the primary.
func (a *app) standbyLine(ctx context.Context, cfg *pgxpool.Config) (string, error) {
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "outboxctl"
	}
	conn, err := pgx.ConnectConfig(ctx, cfg.ConnConfig)
	if err != nil {
		return "", fmt.Errorf("--read-dsn: %w", connectError(cfg, err))
	}
	defer func() { _ = conn.Close(context.Background()) }()
	lag, err := outbox.CompareStandby(ctx, a.pool, conn)
	if err != nil {
		return "", err
	}
	var line string
	if lag.Ticks == 0 {
		line = fmt.Sprintf("standby: caught up (tick %d)", lag.StandbyTick)
	} else {
		line = fmt.Sprintf("standby: %s behind the primary (%s seconds; tick %d of %d)", plural(int(lag.Ticks), "tick", "ticks"),
			strconv.FormatFloat(lag.Lag.Seconds(), 'f', 1, 64), lag.StandbyTick, lag.PrimaryTick)
	}
	if !lag.InRecovery {
		line += "; it is not in recovery: a primary, or a promoted standby"
	}
	return line, nil
}

// statusSummary is the line under the status table: how many consumers, how many behind and
// by how much at worst, and the unresolved dead letters.
func statusSummary(rows []outbox.ConsumerStatus) string {
	var behind, dead, replaying int
	var worstEvents int64
	var worstSeconds float64
	for _, r := range rows {
		if r.LagEvents > 0 {
			behind++
		}
		worstEvents = max(worstEvents, r.LagEvents)
		worstSeconds = max(worstSeconds, r.LagSeconds)
		dead += r.Dead
		replaying += r.ReplayRequested
	}
	return fmt.Sprintf("%s, %d behind (worst lag %s, %s seconds), %s, %d replaying",
		plural(len(rows), "consumer", "consumers"), behind, plural(int(worstEvents), "event", "events"),
		strconv.FormatFloat(worstSeconds, 'f', 1, 64), plural(dead, "dead letter", "dead letters"), replaying)
}

// partialError is the failure of a status left incomplete, or nil.
func partialError(p *outbox.ProjectErrors) error {
	if p == nil {
		return nil
	}
	return fmt.Errorf("%w (the other projects are shown above)", p)
}

func deadLettersCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "dead-letters",
		Short: "List unresolved dead letters (parked, or waiting for a requested replay)",
		Long: `dead-letters lists the deliveries a consumer parked after its last attempt, and those an
operator asked to replay that the consumer has not re-delivered yet. The failure class is a
fixed code (listener_error, listener_panic, listener_timeout, cache_error,
unsupported_event); the error text itself is only in the consumer's log.

After fixing the cause, replay one with:
  outboxctl replay --project P --consumer C --reason TICKET SEQUENCE`,
		Example: `  outboxctl dead-letters
  outboxctl dead-letters --consumer engine --json`,
		Args: cobra.NoArgs,
		RunE: a.action(a.runDeadLetters),
	}
}

func (a *app) runDeadLetters(ctx context.Context, cmd *cobra.Command, _ []string) error {
	if err := a.checkFilters(cmd, false, false, true, true); err != nil {
		return err
	}
	ctx, cancel := a.phase(ctx)
	defer cancel()
	if err := a.open(ctx); err != nil {
		return err
	}
	if err := a.requireKnownConsumer(ctx); err != nil {
		return err
	}
	dead, err := a.admin().DeadLetters(ctx, a.filter())
	if err != nil {
		return err
	}
	if a.json {
		return a.printJSON(nonNil(dead))
	}
	if len(dead) == 0 {
		a.note("no dead letters")
		return nil
	}
	t := newTable(a.stdout, "PROJECT", "CONSUMER", "SEQUENCE", "EVENT_ID", "STATE", "ATTEMPTS", "FAILURE", "PARKED_AT", "REPLAY_REQUESTED_BY")
	for _, d := range dead {
		t.row(d.ProjectID, d.ConsumerID, itoa(d.Sequence), d.EventID, string(d.State), itoa(d.Attempts),
			orDash(d.LastFailureClass), timeText(d.ParkedAt), orDash(d.ReplayRequestedBy))
	}
	return t.flush()
}

// requireKnownConsumer fails when --consumer is set and has no cursor (in --project, if set).
func (a *app) requireKnownConsumer(ctx context.Context) error {
	if a.consumer == "" {
		return nil
	}
	_, err := a.statusOf(ctx)
	return err
}

// nonNil makes an empty result encode as [] rather than null.
func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

// statusOf returns the matching cursors, or an unknown-consumer error when there are none.
func (a *app) statusOf(ctx context.Context) ([]outbox.ConsumerStatus, error) {
	rows, err := a.admin().Status(ctx, a.filter())
	if err != nil {
		return nil, err
	}
	if len(rows) == 0 {
		return nil, a.unknownConsumer()
	}
	return rows, nil
}

// fmtDead summarises a cursor's open deliveries for a plan.
func fmtDead(r outbox.ConsumerStatus) string {
	return fmt.Sprintf("%s, %s", plural(r.Dead+r.ReplayRequested, "unresolved dead letter", "unresolved dead letters"),
		plural(r.Retrying, "retrying delivery", "retrying deliveries"))
}
