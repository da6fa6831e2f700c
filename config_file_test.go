package outbox_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
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
		PollInterval: time.Second, BatchSize: 1000, SequenceBatchSize: 10000, LeaseTTL: 30 * time.Second,
		HeartbeatInterval: 10 * time.Second, ListenerTimeout: 30 * time.Second, NewCursor: "reconcile",
		NotifyChannel: "lifecycle_outbox", NotifyGap: 20 * time.Millisecond, FollowUpInterval: 2 * time.Millisecond,
		FollowUpWindow: 50 * time.Millisecond, WakeInterval: 10 * time.Millisecond,
		LockTimeout: 5 * time.Second, StatementTimeout: 30 * time.Second,
		ListenDSN:          "host=/var/run/postgresql port=5432 dbname=tasks user=engine",
		ListenCheckTimeout: 2 * time.Second, TransactionPooler: true,
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
		"wrong type yaml":      {"batch_size: many\n", "batch_size: line 1: want a value of type int"},
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
