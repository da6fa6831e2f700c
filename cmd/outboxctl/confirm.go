package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os/user"
	"strings"

	"github.com/spf13/cobra"

	"fusion/outbox"
)

// errNotConfirmed is returned when the operator answers anything but yes.
var errNotConfirmed = errors.New("not confirmed: nothing was changed")

// changeFlags are the flags of a command that changes the database.
type changeFlags struct {
	yes    bool
	actor  string
	reason string
}

// addYes adds --yes to cmd.
func (f *changeFlags) addYes(cmd *cobra.Command) {
	cmd.Flags().BoolVarP(&f.yes, "yes", "y", false, "do it without asking; required when stdin is not a terminal")
}

// addOperator adds --yes, --actor and a required --reason to cmd.
func (f *changeFlags) addOperator(cmd *cobra.Command) {
	f.addYes(cmd)
	cmd.Flags().StringVar(&f.actor, "actor", "", "who asks, recorded in the audit row (default: your OS user name)")
	cmd.Flags().StringVar(&f.reason, "reason", "", "why, recorded in the audit row: a ticket reference or short code such as FN-1234, not prose")
	_ = cmd.MarkFlagRequired("reason")
}

// operator returns the validated actor and reason, checked before the plan is shown and a
// confirmation asked (the library checks again when it writes).
func (f *changeFlags) operator() (outbox.Operator, error) {
	op := outbox.Operator{Actor: f.actor, Reason: f.reason}
	if op.Actor == "" {
		u, err := user.Current()
		if err != nil {
			return outbox.Operator{}, usageErrorf("cannot tell who you are (%v): pass --actor", err)
		}
		op.Actor = u.Username
		if (outbox.Operator{Actor: op.Actor, Reason: "x"}).Validate() != nil {
			return outbox.Operator{}, usageErrorf("your OS user name %q is not a valid actor: pass --actor", op.Actor)
		}
	}
	if err := op.Validate(); err != nil {
		var v *outbox.ValidationError
		if errors.As(err, &v) {
			return outbox.Operator{}, usageErrorf("--%s %s", flagName(v.Field), v.Reason)
		}
		return outbox.Operator{}, usageErrorf("%v", err)
	}
	return op, nil
}

// confirm goes ahead with --yes; otherwise it asks on a terminal and refuses without one.
// The plan has been printed on stderr before it is called.
func (a *app) confirm(f *changeFlags, verb string) error {
	if f.yes {
		return nil
	}
	if !a.isTerminal() {
		return usageErrorf("refusing to %s without confirmation: stdin is not a terminal, so pass --yes to confirm", verb)
	}
	fmt.Fprintf(a.stderr, "%s? [y/N] ", capitalize(verb))
	answer, err := bufio.NewReader(a.stdin).ReadString('\n')
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("read confirmation: %w", err)
	}
	switch strings.ToLower(strings.TrimSpace(answer)) {
	case "y", "yes":
		return nil
	}
	return errNotConfirmed
}

func capitalize(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// flagName is the flag that sets a field a ValidationError names by its Go path
// ("Operator.Reason" is --reason).
func flagName(goPath string) string {
	if i := strings.LastIndexByte(goPath, '.'); i >= 0 {
		goPath = goPath[i+1:]
	}
	return strings.ToLower(goPath)
}
