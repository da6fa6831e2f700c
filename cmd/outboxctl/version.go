package main

import (
	"fmt"
	"runtime/debug"
	"strings"

	"fusion/outbox"
)

// versionText is what --version prints: the module's version, the commit it was built from
// and the schema version it expects.
func versionText() string { return versionFrom(debug.ReadBuildInfo()) }

// versionFrom renders a build's information. A build from a work tree has the module version
// "(devel)", which alone tells an operator nothing: the commit (vcs.revision) and whether the
// tree had uncommitted changes (vcs.modified) say which code it is. Builds made without
// version control information (-buildvcs=false, a git worktree, a tarball) say so.
func versionFrom(bi *debug.BuildInfo, ok bool) string {
	module, version, commit := "fusion/outbox", "unreleased", "unknown (built without version control information)"
	if ok {
		if bi.Main.Path != "" {
			module = bi.Main.Path
		}
		if v := bi.Main.Version; v != "" && v != "(devel)" {
			version = v
		}
		var rev, modified string
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				modified = s.Value
			}
		}
		if rev != "" {
			commit = rev
			if modified == "true" {
				commit += " (modified: built with uncommitted changes)"
			}
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "outboxctl %s %s\n", module, version)
	fmt.Fprintf(&b, "commit: %s\n", commit)
	fmt.Fprintf(&b, "schema version: %d\n", outbox.SchemaVersion)
	return b.String()
}
