// Command outboxctl is the operator's tool for the task-lifecycle outbox: it shows consumer
// cursors, lag and dead letters, requests the replay of a dead letter, retires and reinstates
// consumer identities, previews (or runs) a retention sweep, and applies or verifies the
// module's schema. Run `outboxctl --help` for the commands and docs/operations.md for the
// runbook.
//
// Exit codes: 0 success, 1 failure, 2 bad usage (an unknown command or flag, a missing
// required flag, a bad argument, or a change that needs --yes when stdin is not a terminal).
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/term"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], console{
		stdin:      os.Stdin,
		stdout:     os.Stdout,
		stderr:     os.Stderr,
		getenv:     os.Getenv,
		isTerminal: func() bool { return term.IsTerminal(int(os.Stdin.Fd())) },
	})
	stop()
	os.Exit(code)
}
