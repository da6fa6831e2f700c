package main_test

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
)

// TestVersionFlag: --version prints what the binary's own build information says (as `go
// version -m` reads it) and the schema version the build expects, and needs no database.
func TestVersionFlag(t *testing.T) {
	t.Parallel()
	r := ctl(t, nil, "--version")
	require.Equal(t, 0, r.code, "%s", r)
	require.Empty(t, r.stderr)

	out, err := exec.CommandContext(context.Background(), "go", "version", "-m", binary).Output()
	require.NoError(t, err)
	module, version, rev, modified := "", "", "", ""
	for _, l := range strings.Split(string(out), "\n") {
		f := strings.Fields(l)
		switch {
		case len(f) >= 3 && f[0] == "mod":
			module, version = f[1], f[2]
		case len(f) == 2 && f[0] == "build":
			if v, ok := strings.CutPrefix(f[1], "vcs.revision="); ok {
				rev = v
			}
			if v, ok := strings.CutPrefix(f[1], "vcs.modified="); ok {
				modified = v
			}
		}
	}
	require.Equal(t, "fusion/outbox", module)
	if version == "(devel)" {
		version = "unreleased"
	}
	commit := "unknown (built without version control information)"
	if rev != "" {
		commit = rev
		if modified == "true" {
			commit += " (modified: built with uncommitted changes)"
		}
	}
	require.Equal(t, fmt.Sprintf("outboxctl fusion/outbox %s\ncommit: %s\nschema version: %d\n", version, commit, outbox.SchemaVersion), r.stdout)
	require.NotContains(t, r.stdout, "(devel)")
}
