// Command outbox-bench measures the outbox on a real PostgreSQL and prints one JSON line per
// case on stdout (progress goes to stderr).
//
//	outbox-bench [-dsn DSN] [-cpuprofile FILE] <case> [case flags]
//	outbox-bench all
//	outbox-bench chart -in results.jsonl -out scale.png
//
// Without -dsn it starts its own throwaway cluster with durable settings (fsync,
// synchronous_commit and full_page_writes on) and stops it on exit. Every case runs on fresh
// databases created on that server and migrated with the module's and the reference host's
// migrations; -dsn points at an existing server instead (its role needs CREATEDB and CREATEROLE).
//
// Cases: write, write-trace, sequence, drain, latency, fanout, sustained, standby, scale, ooo, reconcile,
// limits, retention, longtx, and all. Run a case with -h for its flags. "chart" needs no database: it
// renders the lines of a results file as a PNG.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"sort"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// runner runs a case and hands each result to emit, which prints it as one JSON line.
type runner func(ctx context.Context, env *Env, emit func(any) error) error

// benchCase is one case: its flags and how to run it.
type benchCase struct {
	name  string
	usage string
	// flags registers the case's flags and returns the function that runs it.
	flags func(fs *flag.FlagSet) runner
	// offline cases need no database: they run with a nil Env and start no cluster.
	offline bool
}

var cases = map[string]benchCase{}

func register(c benchCase) { cases[c.name] = c }

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench:", err)
		os.Exit(1)
	}
}

type globalFlags struct {
	dsn        string
	cpuprofile string
}

func (g *globalFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&g.dsn, "dsn", g.dsn, "an existing PostgreSQL server (its role needs CREATEDB and CREATEROLE); default: a throwaway durable cluster")
	fs.StringVar(&g.cpuprofile, "cpuprofile", g.cpuprofile, "write a CPU profile of the case(s) to this file")
}

func run(args []string, stdout, stderr io.Writer) error {
	var g globalFlags
	top := flag.NewFlagSet("outbox-bench", flag.ContinueOnError)
	top.SetOutput(stderr)
	g.register(top)
	top.Usage = func() {
		fmt.Fprintln(stderr, "usage: outbox-bench [-dsn DSN] [-cpuprofile FILE] <case> [case flags]")
		fmt.Fprintln(stderr, "cases:")
		for _, n := range caseNames() {
			fmt.Fprintf(stderr, "  %-10s %s\n", n, cases[n].usage)
		}
		top.PrintDefaults()
	}
	if err := top.Parse(args); err != nil {
		return err
	}
	if top.NArg() == 0 {
		top.Usage()
		return errors.New("no case given")
	}
	name, rest := top.Arg(0), top.Args()[1:]
	c, ok := cases[name]
	if !ok {
		top.Usage()
		return fmt.Errorf("unknown case %q", name)
	}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	g.register(fs)
	runCase := c.flags(fs)
	if err := fs.Parse(rest); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%s: unexpected arguments %q", name, fs.Args())
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	emit := func(v any) error { return printLine(stdout, v) }
	if c.offline {
		return runCase(ctx, nil, emit)
	}
	logf := func(format string, a ...any) {
		fmt.Fprintf(stderr, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05.000")}, a...)...)
	}
	log := warningsTo(stderr)
	moduleLogger.Store(log)
	defer func() { _ = log.Sync() }()
	env, err := NewServerEnv(ctx, g.dsn, logf)
	if err != nil {
		return err
	}
	defer env.Close()

	if g.cpuprofile != "" {
		f, err := os.Create(g.cpuprofile)
		if err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	started := time.Now()
	err = runCase(ctx, env, emit)
	logf("%s done in %s", name, time.Since(started).Round(time.Millisecond))
	return err
}

func printLine(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode result: %w", err)
	}
	_, err = fmt.Fprintf(w, "%s\n", b)
	return err
}

func caseNames() []string {
	out := make([]string, 0, len(cases))
	for n := range cases {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// one adapts a case function with one result to a runner.
func one[T any](fn func(ctx context.Context, env *Env) (T, error)) runner {
	return func(ctx context.Context, env *Env, emit func(any) error) error {
		r, err := fn(ctx, env)
		if err != nil {
			return err
		}
		return emit(r)
	}
}

// splitList parses "a,b,c".
func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// warningsTo is a logger of warnings and errors, with their time, on w.
func warningsTo(w io.Writer) *zap.Logger {
	enc := zap.NewDevelopmentEncoderConfig()
	enc.EncodeTime = zapcore.TimeEncoderOfLayout("15:04:05.000")
	return zap.New(zapcore.NewCore(zapcore.NewConsoleEncoder(enc), zapcore.AddSync(w), zap.WarnLevel))
}
