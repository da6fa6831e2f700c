package faultsuite

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// TestRoleStopsCleanlyOnSIGTERMDuringStartUp: a role process told to stop while its start-up
// still waits for the database (here a server that accepts connections and hangs up, like a
// PostgreSQL that is restarting) exits cleanly instead of dying of the signal's default
// action. The test sends the signal once the child is provably in start-up: it has connected.
func TestRoleStopsCleanlyOnSIGTERMDuringStartUp(t *testing.T) {
	for _, role := range []string{"writer", "observer"} {
		t.Run(role, func(t *testing.T) {
			t.Parallel()
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			defer ln.Close()
			dir := t.TempDir()
			args := roleArgs{Name: role + "-startup", DSN: fmt.Sprintf("postgres://outbox@%s/outbox?sslmode=disable&connect_timeout=5", ln.Addr()),
				Scope: "node-x", Projects: []string{"p"}, Rate: 1, Log: filepath.Join(dir, role+".log")}
			b, err := json.Marshal(args)
			require.NoError(t, err)
			argsFile := filepath.Join(dir, "args.json")
			require.NoError(t, os.WriteFile(argsFile, b, 0o644))

			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), "FAULTSUITE_ROLE="+role, "FAULTSUITE_ARGS_FILE="+argsFile)
			stderr, err := os.Create(filepath.Join(dir, "stderr"))
			require.NoError(t, err)
			defer stderr.Close()
			cmd.Stderr = stderr
			require.NoError(t, cmd.Start())
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()
			t.Cleanup(func() { _ = cmd.Process.Kill() })

			accepted := make(chan net.Conn, 1)
			go func() {
				if c, err := ln.Accept(); err == nil {
					accepted <- c
				}
			}()
			select {
			case c := <-accepted:
				require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
				_ = c.Close()
			case err := <-exited:
				t.Fatalf("the %s exited before it connected: %v", role, err)
			case <-time.After(2 * time.Minute): // only where it gives up: generous for a busy machine
				t.Fatalf("the %s never tried to connect", role)
			}
			select {
			case err := <-exited:
				out, _ := os.ReadFile(stderr.Name())
				require.NoError(t, err, "the %s did not stop cleanly:\n%s", role, out)
			case <-time.After(2 * time.Minute):
				t.Fatalf("the %s did not stop after SIGTERM", role)
			}
		})
	}
}

// TestStartRetriesWhatTheScheduleCauses: a child's start is tried again after the errors a
// PostgreSQL restart or a terminated backend causes, including PgBouncer's refusal while its
// server_login_retry runs ("obs-a1 exited before it was ready" in a CI run: "FATAL: server
// login has been failing, try again later (server_login_retry) (SQLSTATE 08P01)"), and not
// after any other error.
func TestStartRetriesWhatTheScheduleCauses(t *testing.T) {
	for _, c := range []struct {
		err   error
		retry bool
	}{
		{fmt.Errorf("renew leases: %w", &pgconn.PgError{Severity: "FATAL", Code: pgerrcode.ProtocolViolation, Message: "server login has been failing, try again later (server_login_retry)"}), true},
		{&pgconn.PgError{Severity: "FATAL", Code: pgerrcode.AdminShutdown, Message: "terminating connection due to administrator command"}, true},
		{&pgconn.PgError{Severity: "FATAL", Code: pgerrcode.CannotConnectNow, Message: "the database system is starting up"}, true},
		{&pgconn.PgError{Severity: "ERROR", Code: pgerrcode.InsufficientPrivilege, Message: "permission denied"}, false},
		{errors.New("outbox: invalid config"), false},
	} {
		require.Equal(t, c.retry, startRetryable(c.err), "%v", c.err)
	}
}
