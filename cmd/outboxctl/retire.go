package main

import (
	"context"
	"strings"

	"github.com/spf13/cobra"

	"fusion/outbox"
)

type retireCmd struct {
	app       *app
	reinstate bool
	changeFlags
}

func retireCommand(a *app, reinstate bool) *cobra.Command {
	r := &retireCmd{app: a, reinstate: reinstate}
	cmd := &cobra.Command{
		Use:   "retire",
		Short: "Retire a consumer identity that will not come back",
		Long: `retire marks a consumer identity as retired in --project, or in every project where it has a
cursor when --project is not given, and writes one consumer-retired audit row per project with
--actor and --reason.

A retired consumer:
  - no longer holds back retention: outbox rows it never acknowledged may be pruned;
  - has its unresolved dead letters pruned by the next retention sweep;
  - loses its lease at once, and cannot take one again: a process starting with this identity
    is refused (ErrConsumerRetired) until an operator reinstates it.

Retire an identity only when its process is gone for good (decommissioned, renamed). A
consumer that is merely down keeps its cursor and catches up when it returns; a missed
heartbeat never retires anything.`,
		Example: `  outboxctl retire --consumer dashboard.eu-1 --reason FN-9001
  outboxctl retire --project alpha --consumer engine --reason decommissioned --yes`,
		Args: cobra.NoArgs,
		RunE: a.action(r.run),
	}
	if reinstate {
		cmd.Use = "reinstate"
		cmd.Short = "Undo the retirement of a consumer identity"
		cmd.Long = `reinstate undoes a retirement in --project, or in every project where the identity is retired
when --project is not given, with one consumer-reinstated audit row per project.

The reinstated consumer resumes from its cursor when its process starts. If retention pruned
events past that cursor meanwhile, it reconciles (reason cursor_below_pruned_floor): it
rebuilds its cache from the live tasks and continues from the head, so deletions that were
pruned are reflected but not re-delivered one by one.`
		cmd.Example = `  outboxctl reinstate --consumer dashboard.eu-1 --reason FN-9002`
	}
	r.addOperator(cmd)
	return cmd
}

// retireResult is the JSON output.
type retireResult struct {
	Action     string   `json:"action"`
	ConsumerID string   `json:"consumerId"`
	Projects   []string `json:"projects"`
	Actor      string   `json:"actor,omitempty"`
	Reason     string   `json:"reason,omitempty"`
}

func (r *retireCmd) verb() string {
	if r.reinstate {
		return "reinstate"
	}
	return "retire"
}

func (r *retireCmd) run(ctx context.Context, cmd *cobra.Command, _ []string) error {
	a := r.app
	if err := a.checkFilters(cmd, false, true, true, true); err != nil {
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
	rows, err := a.statusOf(readCtx)
	if err != nil {
		return err
	}
	var targets []outbox.ConsumerStatus
	for _, row := range rows {
		if row.Retired == r.reinstate {
			targets = append(targets, row)
		}
	}
	res := retireResult{Action: r.verb(), ConsumerID: a.consumer, Projects: []string{}}
	if len(targets) == 0 {
		state := "retired"
		if r.reinstate {
			state = "active"
		}
		a.note("consumer %q is already %s in every matching project; nothing to do", a.consumer, state)
		if a.json {
			return a.printJSON(res)
		}
		return nil
	}
	r.printPlan(targets, op)
	if err := a.confirm(&r.changeFlags, r.verb()+" the consumer"); err != nil {
		return err
	}
	writeCtx, cancel := a.phase(ctx)
	defer cancel()
	req := outbox.RetireRequest{ConsumerID: a.consumer, ProjectID: a.project, Operator: op}
	var projects []string
	if r.reinstate {
		projects, err = a.admin().ReinstateConsumer(writeCtx, req)
	} else {
		projects, err = a.admin().RetireConsumer(writeCtx, req)
	}
	if err != nil {
		return err
	}
	res.Projects, res.Actor, res.Reason = nonNil(projects), op.Actor, op.Reason
	if a.json {
		return a.printJSON(res)
	}
	past := map[bool]string{false: "retired", true: "reinstated"}[r.reinstate]
	a.say("%s consumer %s in %s: %s (audited: actor %s, reason %s)", past, a.consumer,
		plural(len(projects), "project", "projects"), strings.Join(projects, ", "), op.Actor, op.Reason)
	return nil
}

func (r *retireCmd) printPlan(targets []outbox.ConsumerStatus, op outbox.Operator) {
	a := r.app
	a.note("outboxctl will %s consumer %q in %s (actor %s, reason %s):", r.verb(), a.consumer,
		plural(len(targets), "project", "projects"), op.Actor, op.Reason)
	for _, t := range targets {
		a.note("  project %s: cursor %s of head %d, %s", t.ProjectID, cursorText(t.Cursor), t.Head, fmtDead(t))
	}
	if r.reinstate {
		a.note("Its process may then take the lease again; it reconciles if events past its cursor were pruned.")
		return
	}
	a.note("Retired, it stops holding back pruning, its unresolved dead letters are pruned by the next")
	a.note("retention sweep, and a process starting with this identity is refused until reinstated.")
}
