package main

import (
	"context"
	"errors"
	"sort"
	"time"

	"github.com/spf13/cobra"

	"fusion/outbox"
)

type pruneCmd struct {
	app *app
	changeFlags
	dryRun bool
	cfg    outbox.Config
}

func pruneCommand(a *app) *cobra.Command {
	p := &pruneCmd{app: a, cfg: outbox.Config{}.WithDefaults()}
	cmd := &cobra.Command{
		Use:   "prune",
		Short: "Preview (--dry-run) or run a retention sweep",
		Long: `prune --dry-run shows, per project, what a retention sweep would prune now, and changes
nothing:

  HEAD            the project's last sequenced event
  PRUNED_THROUGH  the floor: events at or below it may already be gone
  ACKED_THROUGH   the highest sequence every non-retired consumer has acknowledged
  PRUNABLE        events a sweep would delete now: at or below ACKED_THROUGH, older than
                  --retention-window, and not held by an unresolved dead letter of a
                  non-retired consumer
  HELD_BY         the slowest non-retired consumer, the one holding pruning back

Without --dry-run, prune runs one sweep now, as the host's self-healing maintenance does: in
bounded batches, each raising the project's floor. It also prunes resolved dead letters
older than --dead-letter-retention and the unresolved dead letters of retired consumers (the
dry run does not count those). A real prune covers every project.

The windows must match the deployment's outbox configuration (RetentionWindow,
DeadLetterRetention); both default to 720h (30 days).`,
		Example: `  outboxctl prune --dry-run
  outboxctl prune --dry-run --project alpha --json
  outboxctl prune --yes`,
		Args: cobra.NoArgs,
		RunE: a.action(p.run),
	}
	p.addYes(cmd)
	f := cmd.Flags()
	f.BoolVar(&p.dryRun, "dry-run", false, "only show what a sweep would prune")
	f.DurationVar(&p.cfg.RetentionWindow, "retention-window", p.cfg.RetentionWindow, "keep acknowledged events this long (the deployment's RetentionWindow)")
	f.DurationVar(&p.cfg.DeadLetterRetention, "dead-letter-retention", p.cfg.DeadLetterRetention, "keep resolved dead letters this long (the deployment's DeadLetterRetention)")
	cmd.MarkFlagsMutuallyExclusive("dry-run", "yes")
	return cmd
}

// pruneResult is the JSON output of a real prune.
type pruneResult struct {
	PrunedByProject   map[string]int64 `json:"prunedByProject"`
	Pruned            int64            `json:"pruned"`
	DeadLettersPruned int64            `json:"deadLettersPruned"`
	Batches           int              `json:"batches"`
	BudgetExhausted   bool             `json:"budgetExhausted"`
}

func (p *pruneCmd) run(ctx context.Context, cmd *cobra.Command, _ []string) error {
	a := p.app
	if !p.dryRun && a.project != "" {
		return usageErrorf("a real prune covers every project; --project only narrows a --dry-run")
	}
	if err := a.checkFilters(cmd, false, false, true, false); err != nil {
		return err
	}
	for flag, d := range map[string]time.Duration{"--retention-window": p.cfg.RetentionWindow, "--dead-letter-retention": p.cfg.DeadLetterRetention} {
		if d < time.Hour {
			return usageErrorf("%s must be at least 1h (got %s)", flag, d)
		}
	}
	readCtx, cancel := a.phase(ctx)
	defer cancel()
	if err := a.open(readCtx); err != nil {
		return err
	}
	ret, err := outbox.NewRetention(a.pool, p.cfg, nil, nil)
	if err != nil {
		return err
	}
	plans, err := ret.Plan(readCtx)
	if err != nil {
		return err
	}
	if a.project != "" {
		var kept []outbox.PrunePlan
		for _, pl := range plans {
			if pl.ProjectID == a.project {
				kept = append(kept, pl)
			}
		}
		plans = kept
	}
	if p.dryRun {
		return p.printPlan(plans)
	}
	var total int64
	for _, pl := range plans {
		total += pl.Prunable
	}
	a.note("outboxctl will run a retention sweep over every project: about %d outbox rows are prunable now (window %s),", total, p.cfg.RetentionWindow)
	a.note("plus resolved dead letters older than %s and the unresolved dead letters of retired consumers.", p.cfg.DeadLetterRetention)
	if err := a.confirm(&p.changeFlags, "prune"); err != nil {
		return err
	}
	writeCtx, cancel := a.phase(ctx)
	defer cancel()
	res, err := ret.Sweep(writeCtx)
	var partial *outbox.ProjectErrors
	if err != nil && !errors.As(err, &partial) {
		return err
	}
	out := pruneResult{PrunedByProject: res.PrunedByProject, Pruned: res.Pruned(), DeadLettersPruned: res.DeadLettersPruned,
		Batches: res.Batches, BudgetExhausted: res.BudgetExhausted}
	if a.json {
		if err := a.printJSON(out); err != nil {
			return err
		}
		return partialErr(partial)
	}
	projects := make([]string, 0, len(res.PrunedByProject))
	for pr := range res.PrunedByProject {
		projects = append(projects, pr)
	}
	sort.Strings(projects)
	if len(projects) > 0 {
		t := newTable(a.stdout, "PROJECT", "PRUNED")
		for _, pr := range projects {
			t.row(pr, itoa(res.PrunedByProject[pr]))
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	a.say("pruned %d outbox rows and %d dead letters in %s", out.Pruned, out.DeadLettersPruned, plural(out.Batches, "batch", "batches"))
	if out.BudgetExhausted {
		a.note("the sweep stopped at its row budget; run prune again (or let the next maintenance sweep) to continue")
	}
	return partialErr(partial)
}

// partialErr is the error of a sweep that pruned the other projects (nil when none failed).
func partialErr(partial *outbox.ProjectErrors) error {
	if partial == nil {
		return nil
	}
	return partial
}

func (p *pruneCmd) printPlan(plans []outbox.PrunePlan) error {
	a := p.app
	if a.json {
		return a.printJSON(nonNil(plans))
	}
	if len(plans) == 0 {
		a.note("no project has events yet; nothing to prune")
		return nil
	}
	t := newTable(a.stdout, "PROJECT", "HEAD", "PRUNED_THROUGH", "ACKED_THROUGH", "PRUNABLE", "HELD_BY")
	for _, pl := range plans {
		t.row(pl.ProjectID, itoa(pl.Head), itoa(pl.PrunedThrough), itoa(pl.Through), itoa(pl.Prunable), orDash(pl.HeldBy))
	}
	if err := t.flush(); err != nil {
		return err
	}
	a.note("dry run (window %s): nothing was pruned", p.cfg.RetentionWindow)
	return nil
}
