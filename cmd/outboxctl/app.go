package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"fusion/outbox"
	"fusion/outbox/internal/safetext"
)

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// console is what the process gives the command: its streams and environment.
type console struct {
	stdin      io.Reader
	stdout     io.Writer
	stderr     io.Writer
	getenv     func(string) string
	isTerminal func() bool // whether stdin is a terminal, so that a confirmation can be asked
}

// app holds the global flags and the database pool of one invocation.
type app struct {
	console

	dsn      string
	project  string
	consumer string
	json     bool
	timeout  time.Duration

	pool *pgxpool.Pool
}

// run executes one command line and returns the process exit code.
func run(ctx context.Context, args []string, c console) int {
	a := &app{console: c}
	root := a.rootCommand()
	root.SetArgs(args)
	root.SetIn(c.stdin)
	root.SetOut(c.stdout)
	root.SetErr(c.stderr)
	cmd, err := root.ExecuteContextC(ctx)
	if a.pool != nil {
		a.pool.Close()
	}
	if err == nil {
		return exitOK
	}
	var f *failure
	if errors.As(err, &f) {
		fmt.Fprintf(c.stderr, "outboxctl: %s\n", safetext.Printable(a.describe(f.err)))
		return exitFailure
	}
	// Everything else is bad usage: cobra's own errors (unknown command or flag, missing
	// required flag, wrong argument count) and our usageErrors.
	fmt.Fprintf(c.stderr, "outboxctl: %s\nRun '%s --help' for usage.\n", safetext.Printable(err.Error()), cmd.CommandPath())
	return exitUsage
}

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "outboxctl",
		Short: "Operate the task-lifecycle outbox: consumers, lag, dead letters, retention, schema",
		Long: `outboxctl inspects and repairs the task-lifecycle outbox in a PostgreSQL database.

Read-only commands: status, dead-letters, prune --dry-run, verify.
Commands that change the database: replay, retire, reinstate, prune (without --dry-run),
migrate. They first print what they will do (on stderr), then ask for confirmation on a
terminal; when stdin is not a terminal they refuse unless --yes is given. replay, retire and
reinstate write an audit row naming --actor (default: your OS user name) and --reason (a
ticket reference or short code such as FN-1234, never prose).

The database comes from --dsn, or from $DATABASE_URL when --dsn is not given.

--version prints the module version, the commit this build was made from (and whether it had
uncommitted changes) and the schema version it expects.

Exit codes: 0 success; 1 failure (the database is unreachable or its schema does not match,
an unknown consumer, an event that is not a dead letter, a declined confirmation, ...);
2 bad usage (unknown command or flag, missing or invalid flag or argument, or a change
requested without --yes while stdin is not a terminal).`,
		SilenceErrors: true,
		SilenceUsage:  true,
		Version:       versionText(),
		RunE: func(cmd *cobra.Command, args []string) error {
			return usageErrorf("a command is required")
		},
	}
	root.SetVersionTemplate("{{.Version}}")
	root.Flags().Bool("version", false, "print the module version, the commit it was built from and the schema version it expects")
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{err} })
	pf := root.PersistentFlags()
	pf.StringVar(&a.dsn, "dsn", "", "PostgreSQL connection string, URL or key=value (default $DATABASE_URL)")
	pf.StringVar(&a.project, "project", "", "limit the command to one project ID")
	pf.StringVar(&a.consumer, "consumer", "", "limit the command to one consumer identity")
	pf.BoolVar(&a.json, "json", false, "print machine-readable JSON on stdout instead of tables")
	pf.DurationVar(&a.timeout, "timeout", 30*time.Second, "bound on each phase of database work (time spent waiting for your confirmation does not count)")
	root.AddCommand(
		statusCommand(a),
		deadLettersCommand(a),
		replayCommand(a),
		retireCommand(a, false),
		retireCommand(a, true),
		pruneCommand(a),
		migrateCommand(a),
		verifyCommand(a),
	)
	return root
}

// action adapts a command body: its errors are failures (exit 1) unless they are bad usage.
func (a *app) action(fn func(ctx context.Context, cmd *cobra.Command, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		err := fn(cmd.Context(), cmd, args)
		if err == nil {
			return nil
		}
		var u *usageError
		var v *outbox.ValidationError
		switch {
		case errors.As(err, &u):
			return err
		case errors.As(err, &v):
			return &usageError{v}
		}
		return &failure{err}
	}
}

// phase bounds one phase of database work by --timeout.
func (a *app) phase(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, a.timeout)
}

// checkFilters validates --project and --consumer, and requires or rejects them.
func (a *app) checkFilters(cmd *cobra.Command, needProject, needConsumer, allowProject, allowConsumer bool) error {
	switch {
	case needProject && a.project == "":
		return usageErrorf("%s needs --project", cmd.Name())
	case needConsumer && a.consumer == "":
		return usageErrorf("%s needs --consumer", cmd.Name())
	case !allowProject && a.project != "":
		return usageErrorf("%s does not take --project", cmd.Name())
	case !allowConsumer && a.consumer != "":
		return usageErrorf("%s does not take --consumer", cmd.Name())
	}
	if a.project != "" {
		if err := outbox.ValidateProjectID(a.project); err != nil {
			return usageErrorf("--project: %v", err)
		}
	}
	if a.consumer != "" {
		if _, err := outbox.ParseConsumerID(a.consumer); err != nil {
			return usageErrorf("--consumer: %v", err)
		}
	}
	return nil
}

func (a *app) filter() outbox.StatusFilter {
	return outbox.StatusFilter{ProjectID: a.project, ConsumerID: a.consumer}
}

func (a *app) admin() *outbox.Admin {
	return outbox.NewAdmin(a.pool, outbox.AdminOptions{Audit: outbox.TableAuditSink{}})
}

// open connects and checks that the schema is the one this build was written for.
func (a *app) open(ctx context.Context) error {
	if err := a.connect(ctx); err != nil {
		return err
	}
	return outbox.VerifySchema(ctx, a.pool)
}

// connect opens the pool and proves the database answers.
func (a *app) connect(ctx context.Context) error {
	if a.timeout <= 0 {
		return usageErrorf("--timeout must be positive (got %s)", a.timeout)
	}
	dsn, from := a.dsn, "--dsn"
	if dsn == "" {
		dsn, from = a.getenv("DATABASE_URL"), "$DATABASE_URL"
	}
	if dsn == "" {
		return usageErrorf("no database given: pass --dsn or set DATABASE_URL")
	}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		// An invalid flag value is bad usage (exit 2), as --help promises. The DSN itself is
		// never repeated: it may hold a password.
		return usageErrorf("%s does not parse (%s): give a URL such as postgres://user@host:5432/dbname or key=value pairs such as \"host=db dbname=tasks user=oncall\"", from, parseReason(err))
	}
	cfg.MaxConns = 2
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "outboxctl"
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("open connection pool: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return connectError(cfg, err)
	}
	a.pool = pool
	return nil
}
