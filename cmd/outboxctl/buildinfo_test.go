package main

import (
	"fmt"
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
)

// TestVersionFrom: --version names the commit and whether the tree was modified, and never
// prints a bare "(devel)".
func TestVersionFrom(t *testing.T) {
	t.Parallel()
	const rev = "4b2fc96e0d9b2f9bd1c0b6a7de2f3a1c5e6d7f80"
	schema := fmt.Sprintf("schema version: %d\n", outbox.SchemaVersion)
	for _, c := range []struct {
		name string
		bi   *debug.BuildInfo
		ok   bool
		want string
	}{
		{"a work tree build with uncommitted changes",
			&debug.BuildInfo{Main: debug.Module{Path: "fusion/outbox", Version: "(devel)"},
				Settings: []debug.BuildSetting{{Key: "vcs", Value: "git"}, {Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: "true"}}},
			true,
			"outboxctl fusion/outbox unreleased\ncommit: " + rev + " (modified: built with uncommitted changes)\n" + schema},
		{"a clean build with a pseudo-version",
			&debug.BuildInfo{Main: debug.Module{Path: "fusion/outbox", Version: "v0.0.0-20261202093000-4b2fc96e0d9b"},
				Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: "false"}}},
			true,
			"outboxctl fusion/outbox v0.0.0-20261202093000-4b2fc96e0d9b\ncommit: " + rev + "\n" + schema},
		{"a release",
			&debug.BuildInfo{Main: debug.Module{Path: "fusion/outbox", Version: "v1.4.0"}},
			true,
			"outboxctl fusion/outbox v1.4.0\ncommit: unknown (built without version control information)\n" + schema},
		{"no build information", nil, false,
			"outboxctl fusion/outbox unreleased\ncommit: unknown (built without version control information)\n" + schema},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, c.want, versionFrom(c.bi, c.ok))
		})
	}
}
