package main

import (
	"runtime/debug"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestVersionsRecordTheCommit: a stamped build's line carries the full revision in commit, so
// a chart drawn from it can name the commit instead of "(devel)".
func TestVersionsRecordTheCommit(t *testing.T) {
	t.Parallel()
	const rev = "50869dd0b4fbcdfd5a54e37355c553407d9db4dd"
	bi := &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}, Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: "true"}}}
	lib, _, commit := versionsFrom(bi)
	require.Equal(t, rev+"-dirty", commit)
	require.Equal(t, "(devel)+50869dd0b4fb-dirty", lib)

	// go run -buildvcs=true gives a pseudo-version as the module version; the commit is still
	// recorded whole.
	bi.Main.Version = "v0.0.0-20261202092917-50869dd0b4fb"
	bi.Settings = bi.Settings[:1]
	lib, _, commit = versionsFrom(bi)
	require.Equal(t, rev, commit)
	require.Equal(t, bi.Main.Version, lib)

	// An unstamped build (plain go run) records no commit; the chart says "commit unknown".
	lib, _, commit = versionsFrom(&debug.BuildInfo{Main: debug.Module{Version: "(devel)"}})
	require.Empty(t, commit)
	require.Equal(t, libVersionFallback, lib)
}
