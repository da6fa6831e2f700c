// Package testkit holds the helpers the module's tests share: the root package's external
// tests (package outbox_test) and web's. It is imported by tests only: a bound for a test and
// for a wait, seeded events, simulated processes on a throwaway database (through the core's
// public API), and the checks every package's SQL gets.
package testkit

import (
	"context"
	"errors"
	"testing"
	"time"
)

// Ctx bounds a test. Like WaitLimit it only says when to give up, so it is generous: a busy
// machine runs a test many times slower than an idle one.
func Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// WaitLimit bounds a wait for something that should happen. It is a failure bound, not a
// measure of how soon it happens, so it is generous: on a busy machine (two cores shared by a
// whole CI run and other work) what takes milliseconds idle can take many seconds.
const WaitLimit = 2 * time.Minute

// ErrListener is what a failing listener returns; its text must reach no log line, metric or
// page.
var ErrListener = errors.New("listener says no: secret-token-123 and some prose")
