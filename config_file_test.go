package outbox_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"fusion/outbox"
)

// TestLoadTheExampleConfigFile loads testdata/outbox.example.yaml and checks every value.
func TestLoadTheExampleConfigFile(t *testing.T) {
	t.Parallel()
	cfg, err := outbox.LoadConfigFile(filepath.Join("testdata", "outbox.example.yaml"))
	require.NoError(t, err)
	want := outbox.Config{
		IdentityField: "outbox.consumer_id", WriterLabel: "engine-eu",
		PollInterval: time.Second, BatchSize: 1000, AckInterval: time.Second, LeaseTTL: 30 * time.Second,
		HeartbeatInterval: 10 * time.Second, ListenerTimeout: 30 * time.Second, NewCursor: "reconcile",
		NotifyChannel: "lifecycle_outbox", TickChannel: "lifecycle_outbox_tick", TickFloor: 2 * time.Millisecond, TickBusyWait: 25 * time.Millisecond,
		TickFallbackInterval: 5 * time.Second, NotifyGap: 20 * time.Millisecond, FollowUpInterval: 2 * time.Millisecond,
		WakeInterval: 10 * time.Millisecond,
		LockTimeout:  5 * time.Second, StatementTimeout: 30 * time.Second,
		ListenDSN:          "host=/var/run/postgresql port=5432 dbname=tasks user=engine",
		ListenCheckTimeout: 2 * time.Second, TransactionPooler: true, ReadMaxLag: 5 * time.Second,
		RetrySchedule: outbox.DefaultRetrySchedule, MaxAttempts: 10,
		RetentionWindow: 720 * time.Hour, DeadLetterRetention: 720 * time.Hour, RetentionBatchSize: 5000, RetentionBudget: 500000,
	}
	require.Equal(t, want, cfg)
	// Every key of Config appears in the example, so the example documents them all.
	b, err := os.ReadFile(filepath.Join("testdata", "outbox.example.yaml"))
	require.NoError(t, err)
	var keys map[string]any
	require.NoError(t, yaml.Unmarshal(b, &keys))
	for _, k := range outbox.ConfigKeys() {
		require.Contains(t, keys, k, "the example file shows key %s", k)
	}
}

func TestConfigFromJSONAndEmbedded(t *testing.T) {
	t.Parallel()
	var cfg outbox.Config
	require.NoError(t, json.Unmarshal([]byte(`{"poll_interval": "250ms", "retry_schedule": ["1s", "2m"], "max_attempts": 3, "listen_dsn": "host=db"}`), &cfg))
	require.Equal(t, outbox.Config{PollInterval: 250 * time.Millisecond, RetrySchedule: []time.Duration{time.Second, 2 * time.Minute},
		MaxAttempts: 3, ListenDSN: "host=db"}, cfg)

	// A host's own file with the module's section in it, in both formats.
	type hostFile struct {
		DSN    string        `yaml:"dsn" json:"dsn"`
		Outbox outbox.Config `yaml:"outbox" json:"outbox"`
	}
	var y hostFile
	require.NoError(t, yaml.Unmarshal([]byte("dsn: x\noutbox:\n  lease_ttl: 45s\n  notify_disabled: true\n"), &y))
	require.Equal(t, hostFile{DSN: "x", Outbox: outbox.Config{LeaseTTL: 45 * time.Second, NotifyDisabled: true}}, y)
	var j hostFile
	require.NoError(t, json.Unmarshal([]byte(`{"dsn": "x", "outbox": {"lease_ttl": "45s", "notify_disabled": true}}`), &j))
	require.Equal(t, y, j)
}

func TestConfigFileRejectsBadDurationsAndUnknownKeys(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for name, tc := range map[string]struct{ file, want string }{
		"bad duration yaml":    {"poll_interval: soon\n", `poll_interval: line 1: want a duration string such as "1s"`},
		"bare number yaml":     {"lease_ttl: 30\n", "lease_ttl: line 1: want a duration string"},
		"bad list entry yaml":  {"retry_schedule: [1s, later]\n", `retry_schedule: line 1: entry 1: want a duration string`},
		"unknown key yaml":     {"poll_intervall: 1s\n", "poll_intervall: line 1: is not a key of the outbox config"},
		"repeated key yaml":    {"batch_size: 1\nbatch_size: 2\n", "batch_size: line 2: is given twice"},
		"wrong type yaml":      {"batch_size: many\n", "batch_size: line 1: want an integer"},
		"bad duration json":    {`{"poll_interval": "soon"}`, `poll_interval: want a duration string such as "1s"`},
		"bare number json":     {`{"lease_ttl": 30000000000}`, "lease_ttl: want a duration string"},
		"unknown key json":     {`{"clock": "fake"}`, `clock: is not a key of the outbox config`},
		"out of range yaml":    {"poll_interval: 1ms\nbatch_size: 0\nmax_attempts: 5000\n", "MaxAttempts (max_attempts): must be between 1 and 1000"},
		"heartbeat range json": {`{"lease_ttl": "3s", "heartbeat_interval": "2s"}`, "HeartbeatInterval (heartbeat_interval): must be positive"},
	} {
		t.Run(name, func(t *testing.T) {
			ext := ".yaml"
			if strings.HasSuffix(name, "json") {
				ext = ".json"
			}
			path := filepath.Join(dir, strings.ReplaceAll(name, " ", "_")+ext)
			require.NoError(t, os.WriteFile(path, []byte(tc.file), 0o600))
			_, err := outbox.LoadConfigFile(path)
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			require.Contains(t, err.Error(), path, "the error names the file")
		})
	}
	_, err := outbox.LoadConfigFile(filepath.Join(dir, "outbox.toml"))
	require.Error(t, err)
	empty := filepath.Join(dir, "empty.yaml")
	require.NoError(t, os.WriteFile(empty, nil, 0o600))
	cfg, err := outbox.LoadConfigFile(empty)
	require.NoError(t, err, "an empty file is the defaults")
	require.Equal(t, outbox.Config{}, cfg)
}

// TestValidateNamesTheFileKey: the error names the field as the code and the file spell it.
func TestValidateNamesTheFileKey(t *testing.T) {
	t.Parallel()
	err := outbox.Config{PollInterval: time.Millisecond, NotifyChannel: "Bad"}.WithDefaults().Validate()
	require.ErrorContains(t, err, "PollInterval (poll_interval): must be at least 10ms")
	require.ErrorContains(t, err, "NotifyChannel (notify_channel):")
}

// TestConfigKeysAreTagged: every exported field of Config has the same yaml and json key (or
// "-" in both for what is set in code), so a new field cannot be left out of the files.
func TestConfigKeysAreTagged(t *testing.T) {
	t.Parallel()
	typ := reflect.TypeOf(outbox.Config{})
	for i := range typ.NumField() {
		f := typ.Field(i)
		y, j := f.Tag.Get("yaml"), f.Tag.Get("json")
		require.NotEmpty(t, y, "field %s has no yaml key", f.Name)
		require.Equal(t, y, j, "field %s: yaml and json keys differ", f.Name)
	}
}

// secretPassword is the password of the connection string the no-echo tests put where it does
// not belong; no 6-byte piece of it may appear in an error.
const secretPassword = "Zq8Vx7Kp3Wm"

const secretDSN = "postgres://app:" + secretPassword + "@db.internal:5432/tasks"

func requireNoSecret(t *testing.T, err error) {
	t.Helper()
	if err == nil {
		return
	}
	msg := err.Error()
	for i := 0; i+6 <= len(secretPassword); i++ {
		if piece := secretPassword[i : i+6]; strings.Contains(msg, piece) {
			t.Fatalf("the error repeats %q of the password:\n%s", piece, msg)
		}
	}
}

// TestConfigFileErrorsNeverRepeatAValue: a connection string with a password, put under keys
// that do not take it or written so that the parser fails, never comes back in the error,
// whichever path reports it: the decoder, Validate, or the YAML and JSON parsers. The error
// still names the key.
func TestConfigFileErrorsNeverRepeatAValue(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for i, tc := range []struct{ ext, file, want string }{
		{".yaml", "poll_interval: " + secretDSN + "\n", "poll_interval: line 1: want a duration string"},
		{".yaml", "poll_interval: '" + secretDSN + "'\n", "poll_interval: line 1: want a duration string"},
		{".yaml", "lease_ttl: [" + secretDSN + "]\n", "lease_ttl: line 1: want a duration string"},
		{".yaml", "lease_ttl: {dsn: " + secretDSN + "}\n", "lease_ttl: line 1: want a duration string"},
		{".yaml", "retry_schedule: [1s, " + secretDSN + "]\n", "retry_schedule: line 1: entry 1: want a duration string"},
		{".yaml", "retry_schedule: [1s, [" + secretDSN + "]]\n", "retry_schedule: line 1: entry 1: want a duration string"},
		{".yaml", "retry_schedule: " + secretDSN + "\n", "retry_schedule: line 1: want a list of duration strings"},
		{".yaml", "batch_size: " + secretDSN + "\n", "batch_size: line 1: want an integer"},
		{".yaml", "notify_disabled: " + secretDSN + "\n", "notify_disabled: line 1: want true or false"},
		{".yaml", "listen_dsn: {password: " + secretPassword + "}\n", "listen_dsn: line 1: want a string"},
		{".yaml", "new_cursor: " + secretDSN + "\n", "NewCursor (new_cursor): must be"},
		{".yaml", "notify_channel: " + secretDSN + "\n", "NotifyChannel (notify_channel): must be"},
		{".yaml", "identity_field: " + secretDSN + "\n", "IdentityField (identity_field): must be"},
		{".yaml", "writer_label: " + secretDSN + "\n", "WriterLabel (writer_label): must be"},
		{".yaml", "listen_dsn: 'postgres://app:" + secretPassword + "@db:notaport/x'\n", "ListenDSN (listen_dsn): does not parse"},
		{".yaml", "read_dsn: 'postgres://app:" + secretPassword + "@db:notaport/x'\n", "ReadDSN (read_dsn): does not parse"},
		{".yaml", secretDSN + ": 1s\n", "is not a key of the outbox config"},
		{".yaml", "listen_dsn: \"" + secretDSN + "\n", "line 2: not valid YAML"},
		{".yaml", "listen_dsn: *" + secretPassword + "\n", "not valid YAML"},
		{".yaml", "listen_dsn: !" + secretPassword + " x\npoll_interval: !" + secretPassword + " 1s\n", "poll_interval: line 2: want a duration string"},
		{".yaml", "listen_dsn: x\n\t" + secretDSN + "\n", "not valid YAML"},
		{".yaml", "- " + secretDSN + "\n", "line 1: want a mapping"},
		{".json", `{"poll_interval": "` + secretDSN + `"}`, "poll_interval: want a duration string"},
		{".json", `{"poll_interval": ["` + secretDSN + `"]}`, "poll_interval: want a duration string"},
		{".json", `{"retry_schedule": ["1s", "` + secretDSN + `"]}`, "retry_schedule: entry 1: want a duration string"},
		{".json", `{"retry_schedule": ["1s", {"a": "` + secretDSN + `"}]}`, "retry_schedule: entry 1: want a duration string"},
		{".json", `{"retry_schedule": "` + secretDSN + `"}`, "retry_schedule: want a list of duration strings"},
		{".json", `{"max_attempts": "` + secretDSN + `"}`, "max_attempts: want an integer"},
		{".json", `{"listen_dsn": {"password": "` + secretPassword + `"}}`, "listen_dsn: want a string"},
		{".json", `{"new_cursor": "` + secretDSN + `"}`, "NewCursor (new_cursor): must be"},
		{".json", `{"` + secretDSN + `": "1s"}`, "is not a key of the outbox config"},
		{".json", `{"listen_dsn": "` + secretDSN + `", }`, "line 1, column"},
		{".json", `{"listen_dsn": ` + secretDSN + `}`, "line 1, column 16: not valid JSON"},
		{".json", "{\"listen_dsn\": \"x\",\n \"poll_interval\": \"" + secretPassword + "\x01\"}", "line 2, column"},
		{".json", `"` + secretDSN + `"`, "want an object"},
	} {
		t.Run(fmt.Sprintf("%d%s", i, tc.ext), func(t *testing.T) {
			path := filepath.Join(dir, fmt.Sprintf("secret-%d%s", i, tc.ext))
			require.NoError(t, os.WriteFile(path, []byte(tc.file), 0o600))
			_, err := outbox.LoadConfigFile(path)
			require.Error(t, err)
			requireNoSecret(t, err)
			require.Contains(t, err.Error(), tc.want)
			t.Log(strings.TrimPrefix(err.Error(), path+": "))
		})
	}
}

// TestConfigFileIsBounded: a file past 64 KiB (MaxConfigFileBytes) is refused unread, and
// refusing the 4 MB retry_schedule of the report (accepted after 2.3s and 503 MB) allocates
// little: the bytes allocated while loading it are counted, not timed. The test is not
// parallel, so that no other test allocates meanwhile.
func TestConfigFileIsBounded(t *testing.T) {
	dir := t.TempDir()
	const limit = 64 << 10
	const key = "batch_size: 10\n"
	pad := limit - len(key) // odd: one comment line of three bytes, the rest of two
	atLimit := "##\n" + strings.Repeat("#\n", (pad-3)/2) + key
	require.Len(t, atLimit, limit)
	path := filepath.Join(dir, "at-limit.yaml")
	require.NoError(t, os.WriteFile(path, []byte(atLimit), 0o600))
	cfg, err := outbox.LoadConfigFile(path)
	require.NoError(t, err, "a file of exactly the limit loads")
	require.Equal(t, 10, cfg.BatchSize)

	path = filepath.Join(dir, "over-limit.yaml")
	require.NoError(t, os.WriteFile(path, []byte(atLimit+"\n"), 0o600))
	_, err = outbox.LoadConfigFile(path)
	require.ErrorContains(t, err, "larger than 65536 bytes, the limit (MaxConfigFileBytes)")

	var big strings.Builder
	big.WriteString("retry_schedule:\n")
	for big.Len() < 4<<20 {
		big.WriteString("  - 1s\n")
	}
	for _, ext := range []string{".yaml", ".json"} {
		path := filepath.Join(dir, "big"+ext)
		body := big.String()
		if ext == ".json" {
			body = `{"retry_schedule": [` + strings.Repeat(`"1s", `, (4<<20)/6) + `"1s"]}`
		}
		require.NoError(t, os.WriteFile(path, []byte(body), 0o600))
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		_, err := outbox.LoadConfigFile(path)
		runtime.ReadMemStats(&after)
		require.ErrorContains(t, err, "the limit (MaxConfigFileBytes)", ext)
		allocated := after.TotalAlloc - before.TotalAlloc
		t.Logf("%s: refusing a %d-byte file allocated %d bytes", ext, len(body), allocated)
		require.Less(t, allocated, uint64(4<<20), "%s: refusing the file allocated %d bytes", ext, allocated)
	}
}

// TestConfigListsAreBounded: retry_schedule takes at most 100 entries (MaxConfigListEntries)
// in a file, in a host's own file that embeds a Config (no file limit there), and set in code.
func TestConfigListsAreBounded(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	list := func(n int) []string { return slices.Repeat([]string{"1s"}, n) }
	yamlOf := func(n int) string { return "retry_schedule: [" + strings.Join(list(n), ", ") + "]\n" }
	jsonOf := func(n int) string { return `{"retry_schedule": ["` + strings.Join(list(n), `", "`) + `"]}` }
	const want = "has more than 100 entries, the limit (MaxConfigListEntries)"

	for _, tc := range []struct{ ext, body string }{{".yaml", yamlOf(100)}, {".json", jsonOf(100)}} {
		path := filepath.Join(dir, "100"+tc.ext)
		require.NoError(t, os.WriteFile(path, []byte(tc.body), 0o600))
		cfg, err := outbox.LoadConfigFile(path)
		require.NoError(t, err, tc.ext)
		require.Len(t, cfg.RetrySchedule, 100)
	}
	for _, tc := range []struct{ ext, body string }{{".yaml", yamlOf(101)}, {".json", jsonOf(101)}, {".yaml", yamlOf(5000)}} {
		path := filepath.Join(dir, "over"+tc.ext)
		require.NoError(t, os.WriteFile(path, []byte(tc.body), 0o600))
		_, err := outbox.LoadConfigFile(path)
		require.ErrorContains(t, err, "retry_schedule: ", tc.ext)
		require.ErrorContains(t, err, want, tc.ext)
	}

	type hostFile struct {
		Outbox outbox.Config `yaml:"outbox" json:"outbox"`
	}
	var y hostFile
	require.ErrorContains(t, yaml.Unmarshal([]byte("outbox:\n  "+yamlOf(101)), &y), want)
	var j hostFile
	require.ErrorContains(t, json.Unmarshal([]byte(`{"outbox": `+jsonOf(101)+`}`), &j), want)

	err := outbox.Config{RetrySchedule: make([]time.Duration, 101)}.WithDefaults().Validate()
	require.ErrorContains(t, err, "RetrySchedule (retry_schedule): "+want)
}
