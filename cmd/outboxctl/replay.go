package main

import (
	"context"
	"fmt"
	"strconv"

	"github.com/spf13/cobra"

	"fusion/outbox"
)

type replayCmd struct {
	app *app
	changeFlags
	all bool
}

func replayCommand(a *app) *cobra.Command {
	r := &replayCmd{app: a}
	cmd := &cobra.Command{
		Use:   "replay [SEQUENCE...]",
		Short: "Ask a consumer to re-deliver dead letters after the cause was fixed",
		Long: `replay marks dead letters of one consumer for replay. Only that consumer sees the
request: on its next scan it re-delivers the event to its listeners, resolves the dead letter
and writes a consumer-replayed audit row naming --actor and --reason. If the listener fails
again the event goes back to dead. Other consumers are not affected.

Name the events by their sequence in the project, as dead-letters lists them, or pass --all
to replay every dead letter of --consumer (in --project, or in every project).

Fix the cause first: a replay of an event whose listener still fails only parks it again.`,
		Example: `  outboxctl dead-letters --consumer engine
  outboxctl replay --project alpha --consumer engine --reason FN-8690 17
  outboxctl replay --consumer engine --all --reason FN-8690 --yes`,
		RunE: a.action(r.run),
	}
	r.addOperator(cmd)
	cmd.Flags().BoolVar(&r.all, "all", false, "replay every dead letter of --consumer (in --project, if given)")
	return cmd
}

// replayItem is one dead letter to replay.
type replayItem struct {
	ProjectID  string `json:"projectId"`
	ConsumerID string `json:"consumerId"`
	Sequence   int64  `json:"sequence"`
	EventID    string `json:"eventId"`
	State      string `json:"state"`
}

func (r *replayCmd) run(ctx context.Context, cmd *cobra.Command, args []string) error {
	a := r.app
	if err := a.checkFilters(cmd, !r.all, true, true, true); err != nil {
		return err
	}
	seqs, err := r.sequences(args)
	if err != nil {
		return err
	}
	op, err := r.operator()
	if err != nil {
		return err
	}
	readCtx, cancel := a.phase(ctx)
	defer cancel()
	if err := a.open(readCtx); err != nil {
		return err
	}
	items, err := r.plan(readCtx, seqs)
	if err != nil {
		return err
	}
	if len(items) == 0 {
		a.note("consumer %q has no dead letters to replay", a.consumer)
		if a.json {
			return a.printJSON([]replayItem{})
		}
		return nil
	}
	a.note("outboxctl will ask consumer %q to replay %s (actor %s, reason %s):", a.consumer,
		plural(len(items), "dead letter", "dead letters"), op.Actor, op.Reason)
	for _, it := range items {
		a.note("  project %s, sequence %d, event %s", it.ProjectID, it.Sequence, it.EventID)
	}
	if err := a.confirm(&r.changeFlags, "request the replay"); err != nil {
		return err
	}
	writeCtx, cancel := a.phase(ctx)
	defer cancel()
	var done []replayItem
	for _, it := range items {
		eventID, err := a.admin().RequestReplay(writeCtx, outbox.ReplayRequest{
			ProjectID: it.ProjectID, ConsumerID: it.ConsumerID, Sequence: it.Sequence, Operator: op})
		if err != nil {
			if len(done) > 0 {
				return fmt.Errorf("%w (replay was requested for the %s before it)", err, plural(len(done), "dead letter listed", "dead letters listed"))
			}
			return err
		}
		it.EventID, it.State = eventID, "replay_requested"
		done = append(done, it)
		if !a.json {
			a.say("replay requested: project %s, consumer %s, sequence %d, event %s", it.ProjectID, it.ConsumerID, it.Sequence, eventID)
		}
	}
	if a.json {
		return a.printJSON(done)
	}
	a.note("the consumer re-delivers on its next scan; follow it with `outboxctl dead-letters --consumer %s`", a.consumer)
	return nil
}

// sequences parses the SEQUENCE arguments.
func (r *replayCmd) sequences(args []string) ([]int64, error) {
	if r.all {
		if len(args) > 0 {
			return nil, usageErrorf("replay takes either SEQUENCE arguments or --all, not both")
		}
		return nil, nil
	}
	if len(args) == 0 {
		return nil, usageErrorf("replay needs the SEQUENCE of at least one dead letter (see `outboxctl dead-letters`), or --all")
	}
	out := make([]int64, 0, len(args))
	seen := map[int64]bool{}
	for _, s := range args {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil || v < 1 {
			return nil, usageErrorf("SEQUENCE must be a positive integer (got %q)", s)
		}
		if !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	return out, nil
}

// plan checks that every requested sequence is a dead letter of the consumer, before anything
// is changed or confirmed.
func (r *replayCmd) plan(ctx context.Context, seqs []int64) ([]replayItem, error) {
	a := r.app
	if _, err := a.statusOf(ctx); err != nil {
		return nil, err
	}
	letters, err := a.admin().DeadLetters(ctx, a.filter())
	if err != nil {
		return nil, err
	}
	bySeq := map[int64]outbox.DeadLetter{}
	var items []replayItem
	for _, d := range letters {
		bySeq[d.Sequence] = d
		if r.all && d.State == "dead" {
			items = append(items, replayItem{d.ProjectID, d.ConsumerID, d.Sequence, d.EventID, string(d.State)})
		}
	}
	for _, s := range seqs {
		d, ok := bySeq[s]
		switch {
		case !ok:
			return nil, fmt.Errorf("%w: consumer %q has no dead letter at sequence %d of project %q (see `outboxctl dead-letters`)",
				outbox.ErrNotDeadLetter, a.consumer, s, a.project)
		case d.State != "dead":
			return nil, fmt.Errorf("%w: sequence %d of project %q for consumer %q already awaits replay (requested by %s)",
				outbox.ErrNotDeadLetter, s, a.project, a.consumer, orDash(d.ReplayRequestedBy))
		}
		items = append(items, replayItem{d.ProjectID, d.ConsumerID, d.Sequence, d.EventID, string(d.State)})
	}
	return items, nil
}
