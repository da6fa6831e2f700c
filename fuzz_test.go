package outbox_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unicode"

	"fusion/outbox"
)

func FuzzParseConsumerID(f *testing.F) {
	for _, s := range []string{"dashboard", "engine.eu-1", "a", "", " lead", "trail ", "tab\tin", "-dash", "x/y", "ünïcode",
		strings.Repeat("a", 128), strings.Repeat("a", 129), "node:1_2.3-4"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		id, err := outbox.ParseConsumerID(s)
		if err != nil {
			if id != "" {
				t.Fatalf("error with a value: %q", id)
			}
			return
		}
		if string(id) != s {
			t.Fatalf("parsed %q into %q: no silent trimming or rewriting", s, id)
		}
		if len(s) < 1 || len(s) > 128 || strings.IndexFunc(s, unicode.IsSpace) >= 0 {
			t.Fatalf("accepted %q", s)
		}
		for _, r := range s {
			if !(r < 128 && (unicode.IsLetter(r) || unicode.IsDigit(r) || strings.ContainsRune("._:-", r))) {
				t.Fatalf("accepted %q with %q", s, r)
			}
		}
	})
}

func FuzzConfigValidate(f *testing.F) {
	f.Add(int64(0), 0, int64(0), int64(0), int64(0), 0, "", "", int64(0), 0, 0)
	f.Add(int64(time.Second), 1000, int64(30*time.Second), int64(10*time.Second), int64(30*time.Second), 10, "outbox.consumer_id", "lifecycle_outbox", int64(720*time.Hour), 5000, 500000)
	f.Add(int64(-1), -5, int64(1), int64(-1), int64(0), -1, "bad field", "Bad-Channel", int64(-time.Hour), -1, 1)
	f.Fuzz(func(t *testing.T, poll int64, batch int, ttl, heartbeat, timeout int64, attempts int, field, channel string,
		window int64, retentionBatch, budget int) {
		cfg := outbox.Config{PollInterval: time.Duration(poll), BatchSize: batch, LeaseTTL: time.Duration(ttl),
			HeartbeatInterval: time.Duration(heartbeat), ListenerTimeout: time.Duration(timeout), MaxAttempts: attempts,
			IdentityField: field, NotifyChannel: channel, RetentionWindow: time.Duration(window),
			RetentionBatchSize: retentionBatch, RetentionBudget: budget}.WithDefaults()
		err := cfg.Validate()
		if err != nil {
			if !strings.HasPrefix(err.Error(), "outbox config: ") {
				t.Fatalf("error does not say where it comes from: %v", err)
			}
			return
		}
		switch {
		case cfg.PollInterval < 10*time.Millisecond, cfg.BatchSize < 1, cfg.BatchSize > 10000,
			cfg.LeaseTTL < time.Second, cfg.HeartbeatInterval <= 0, cfg.HeartbeatInterval*3 > cfg.LeaseTTL,
			cfg.ListenerTimeout < time.Millisecond, cfg.MaxAttempts < 1, cfg.MaxAttempts > 1000,
			cfg.RetentionWindow < time.Hour, cfg.RetentionBatchSize < 1, cfg.RetentionBudget < cfg.RetentionBatchSize:
			t.Fatalf("accepted an out-of-range config: %+v", cfg)
		}
		if _, err := outbox.ParseConsumerID(cfg.IdentityField); err != nil {
			t.Fatalf("accepted identity field %q: %v", cfg.IdentityField, err)
		}
	})
}

func FuzzParseEventID(f *testing.F) {
	for _, s := range []string{"task-deleted:t1:2026-11-30T12:00:00.000000Z", "task-deleted:a:b:c:2026-01-02T03:04:05.123456Z",
		"task-deleted::2026-01-02T03:04:05.123456Z", "task-deleted:t1:2026-11-30T12:00:00Z", "task-archived:t1:2026-11-30T12:00:00.000000Z",
		"task-deleted:t1:2026-13-30T12:00:00.000000Z", "task-deleted:t 1:2026-11-30T12:00:00.000000Z", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		task, at, err := outbox.ParseEventID(s)
		if err != nil {
			return
		}
		if got := outbox.TaskDeletedEventID(task, at); got != s {
			t.Fatalf("%q parsed to (%q, %s) which formats as %q", s, task, at, got)
		}
		if at.Nanosecond()%1000 != 0 || at.Location() != time.UTC {
			t.Fatalf("%q: deletedAt %s is not canonical", s, at)
		}
	})
}

func FuzzParseWakePayload(f *testing.F) {
	for _, s := range []string{"alpha", "proj-0001", "", "a b", `{"project":"x"}`, "drop table;", strings.Repeat("p", 129), "ok:1.2_3-4"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := outbox.ParseWakePayload(s)
		if err != nil {
			return
		}
		if p != s || outbox.ValidateProjectID(p) != nil {
			t.Fatalf("payload %q accepted as %q", s, p)
		}
	})
}

func FuzzDecodeEvent(f *testing.F) {
	at := time.Date(2026, 11, 30, 12, 0, 0, 123456000, time.UTC)
	f.Add("alpha", int64(1), outbox.TaskDeletedEventID("t1", at), "task:deleted", "t1", at.UnixMicro(), "writer-1", 1)
	f.Add("alpha", int64(0), "task-deleted:t1:x", "task:archived", "t2", int64(-1), "", 99)
	f.Fuzz(func(t *testing.T, project string, seq int64, eventID, eventType, task string, deletedMicros int64, writer string, version int) {
		ev := outbox.Event{ProjectID: project, Sequence: seq, EventID: eventID, EventType: eventType, TaskID: task,
			DeletedAt: time.UnixMicro(deletedMicros).UTC(), WriterProcessID: writer, PayloadVersion: version}
		if err := ev.Validate(); err != nil {
			return
		}
		if ev.EventType != outbox.EventTypeTaskDeleted || ev.PayloadVersion != outbox.PayloadVersion || ev.Sequence < 1 {
			t.Fatalf("accepted %+v", ev)
		}
		if outbox.TaskDeletedEventID(ev.TaskID, ev.DeletedAt) != ev.EventID {
			t.Fatalf("accepted an event whose ID does not match its task and deletedAt: %+v", ev)
		}
	})
}

// FuzzLoadConfigFileNeverEchoes puts a connection string with a password (secretDSN) into a
// configuration file under any key, in any of several shapes, with fuzzed text around it that
// may break the syntax, and checks that no error LoadConfigFile returns holds a piece of the
// password, whichever of the decoder, Validate or the YAML and JSON parsers reports it.
func FuzzLoadConfigFileNeverEchoes(f *testing.F) {
	for shape := range 8 {
		f.Add(uint8(shape), uint8(shape*3), false, "", "")
		f.Add(uint8(shape), uint8(shape*5), true, "", "")
	}
	f.Add(uint8(0), uint8(4), false, "'", "")
	f.Add(uint8(0), uint8(1), false, "*", "")
	f.Add(uint8(0), uint8(7), false, "!", " 1s")
	f.Add(uint8(3), uint8(2), true, `"`, `"`)
	f.Add(uint8(0), uint8(9), true, `\u00`, "")
	f.Add(uint8(1), uint8(12), false, "\t", "\n\t")
	keys := append(outbox.ConfigKeys(), "not_a_key")
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, shape, key uint8, asJSON bool, pre, post string) {
		k := keys[int(key)%len(keys)]
		v := pre + secretDSN + post
		var doc, ext string
		if asJSON {
			ext = ".json"
			doc = []string{
				`{"` + k + `": "` + v + `"}`,
				`{"` + k + `": ["1s", "` + v + `"]}`,
				`{"` + k + `": {"a": "` + v + `"}}`,
				`{"` + k + `": ` + v + `}`,
				`{"` + v + `": 1}`,
				`{"listen_dsn": "x", "` + k + `": "` + v + `", "batch_size": 1}`,
				`[` + v + `]`,
				v,
			}[shape%8]
		} else {
			ext = ".yaml"
			doc = []string{
				k + ": " + v + "\n",
				k + ": '" + v + "'\n",
				k + `: "` + v + "\"\n",
				k + ": [1s, " + v + "]\n",
				k + ": {a: " + v + "}\n",
				k + ":\n  - " + v + "\n",
				v + ": " + k + "\n",
				v,
			}[shape%8]
		}
		path := filepath.Join(dir, "fuzz"+ext)
		if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := outbox.LoadConfigFile(path)
		requireNoSecret(t, err)
	})
}
