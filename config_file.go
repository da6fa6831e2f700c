package outbox

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	"go.yaml.in/yaml/v3"
)

// Config as hosts load it: from a YAML or JSON file (or a section of their own file that
// embeds a Config), with the keys of the field tags. Durations are Go duration strings ("1s",
// "250ms", "720h"); a bare number is refused, since its unit would be a guess. Unknown keys
// are refused too: a misspelt key would otherwise leave its setting at the default without a
// word. TracerProvider and Clock are set in code and have no key.

// configKey is one file key of Config.
type configKey struct {
	index  int
	goName string
	key    string
	typ    reflect.Type
}

var (
	configKeysOnce sync.Once
	configKeys     map[string]configKey // by file key
	configGoNames  map[string]string    // Go field name -> file key
)

var (
	durationType  = reflect.TypeOf(time.Duration(0))
	durationsType = reflect.TypeOf([]time.Duration(nil))
)

// loadConfigKeys reads the keys from Config's tags. A field whose yaml and json names differ
// is a programming error that the tests catch (TestConfigKeysAreTagged).
func loadConfigKeys() {
	configKeys, configGoNames = map[string]configKey{}, map[string]string{}
	t := reflect.TypeOf(Config{})
	for i := range t.NumField() {
		f := t.Field(i)
		key, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if key == "" || key == "-" || !f.IsExported() {
			continue
		}
		configKeys[key] = configKey{index: i, goName: f.Name, key: key, typ: f.Type}
		configGoNames[f.Name] = key
	}
}

// fieldLabel is how Validate names a field: "PollInterval (poll_interval)".
func fieldLabel(goName string) string {
	configKeysOnce.Do(loadConfigKeys)
	if key, ok := configGoNames[goName]; ok {
		return "Config." + goName + " (" + key + ")"
	}
	return "Config." + goName
}

// ConfigKeys lists the file keys of Config, in field order.
func ConfigKeys() []string {
	configKeysOnce.Do(loadConfigKeys)
	ks := make([]configKey, 0, len(configKeys))
	for _, k := range configKeys {
		ks = append(ks, k)
	}
	slices.SortFunc(ks, func(a, b configKey) int { return a.index - b.index })
	out := make([]string, len(ks))
	for i, k := range ks {
		out[i] = k.key
	}
	return out
}

// decodeError names the file key whose value is bad.
func decodeError(key, format string, args ...any) error {
	return &ValidationError{Field: key, Reason: fmt.Sprintf(format, args...)}
}

const wantDuration = `want a duration string such as "1s", "250ms" or "720h"`

func parseDurationValue(key, s string) (time.Duration, error) {
	d, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil {
		return 0, decodeError(key, "%s (got %q)", wantDuration, s)
	}
	return d, nil
}

// UnmarshalJSON decodes a JSON object with Config's keys into c, refusing unknown keys and
// reading durations from strings. Keys absent from the object keep c's values.
func (c *Config) UnmarshalJSON(b []byte) error {
	if bytes.Equal(bytes.TrimSpace(b), []byte("null")) {
		return nil
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return fmt.Errorf("outbox config: want an object: %w", err)
	}
	configKeysOnce.Do(loadConfigKeys)
	out := *c
	v := reflect.ValueOf(&out).Elem()
	var errs []error
	for _, key := range sortedKeys(raw) {
		msg := raw[key]
		k, ok := configKeys[key]
		if !ok {
			errs = append(errs, decodeError(key, "is not a key of the outbox config (keys: %s)", strings.Join(ConfigKeys(), ", ")))
			continue
		}
		fv := v.Field(k.index)
		switch k.typ {
		case durationType:
			var s string
			if err := json.Unmarshal(msg, &s); err != nil {
				errs = append(errs, decodeError(key, "%s (got %s)", wantDuration, msg))
				continue
			}
			d, err := parseDurationValue(key, s)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			fv.SetInt(int64(d))
		case durationsType:
			var ss []string
			if err := json.Unmarshal(msg, &ss); err != nil {
				errs = append(errs, decodeError(key, "want a list of duration strings such as [\"1s\", \"5s\"] (got %s)", msg))
				continue
			}
			ds, err := parseDurations(key, ss)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			fv.Set(reflect.ValueOf(ds))
		default:
			dec := json.NewDecoder(bytes.NewReader(msg))
			dec.DisallowUnknownFields()
			if err := dec.Decode(fv.Addr().Interface()); err != nil {
				errs = append(errs, decodeError(key, "want a value of type %s (got %s)", k.typ, msg))
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("outbox config: %w", errors.Join(errs...))
	}
	*c = out
	return nil
}

// UnmarshalYAML decodes a YAML mapping with Config's keys into c, refusing unknown and
// repeated keys and reading durations from strings. Keys absent from the mapping keep c's
// values.
func (c *Config) UnmarshalYAML(node *yaml.Node) error {
	if node.Kind == yaml.ScalarNode && node.Tag == "!!null" {
		return nil
	}
	if node.Kind != yaml.MappingNode {
		return fmt.Errorf("outbox config: line %d: want a mapping of keys to values", node.Line)
	}
	configKeysOnce.Do(loadConfigKeys)
	out := *c
	v := reflect.ValueOf(&out).Elem()
	var errs []error
	seen := map[string]bool{}
	bad := func(n *yaml.Node, key, format string, args ...any) {
		errs = append(errs, decodeError(key, "line %d: "+format, append([]any{n.Line}, args...)...))
	}
	for i := 0; i+1 < len(node.Content); i += 2 {
		kn, vn := node.Content[i], node.Content[i+1]
		key := kn.Value
		if seen[key] {
			bad(kn, key, "is given twice")
			continue
		}
		seen[key] = true
		k, ok := configKeys[key]
		if !ok {
			bad(kn, key, "is not a key of the outbox config (keys: %s)", strings.Join(ConfigKeys(), ", "))
			continue
		}
		fv := v.Field(k.index)
		switch k.typ {
		case durationType:
			if vn.Kind != yaml.ScalarNode || vn.Tag != "!!str" {
				bad(vn, key, "%s (got %s)", wantDuration, vn.Value)
				continue
			}
			d, err := parseDurationValue(key, vn.Value)
			if err != nil {
				bad(vn, key, "%s (got %q)", wantDuration, vn.Value)
				continue
			}
			fv.SetInt(int64(d))
		case durationsType:
			if vn.Kind != yaml.SequenceNode {
				bad(vn, key, "want a list of duration strings such as [1s, 5s]")
				continue
			}
			ss := make([]string, 0, len(vn.Content))
			ok := true
			for _, item := range vn.Content {
				if item.Kind != yaml.ScalarNode || item.Tag != "!!str" {
					bad(item, key, "%s (got %s)", wantDuration, item.Value)
					ok = false
					break
				}
				ss = append(ss, item.Value)
			}
			if !ok {
				continue
			}
			ds, err := parseDurations(key, ss)
			if err != nil {
				bad(vn, key, "%v", err.(*ValidationError).Reason)
				continue
			}
			fv.Set(reflect.ValueOf(ds))
		default:
			if vn.Kind != yaml.ScalarNode {
				bad(vn, key, "want a value of type %s", k.typ)
				continue
			}
			if err := vn.Decode(fv.Addr().Interface()); err != nil {
				bad(vn, key, "want a value of type %s (got %q)", k.typ, vn.Value)
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("outbox config: %w", errors.Join(errs...))
	}
	*c = out
	return nil
}

func parseDurations(key string, ss []string) ([]time.Duration, error) {
	ds := make([]time.Duration, 0, len(ss))
	for i, s := range ss {
		d, err := time.ParseDuration(strings.TrimSpace(s))
		if err != nil {
			return nil, decodeError(key, "entry %d: %s (got %q)", i, wantDuration, s)
		}
		ds = append(ds, d)
	}
	return ds, nil
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// LoadConfigFile reads a Config from a .yaml, .yml or .json file and validates it (with the
// defaults applied), so that a bad file fails at load with the keys it uses. It returns the
// configuration as the file gave it: the constructors apply the defaults.
func LoadConfigFile(path string) (Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("outbox config: %w", err)
	}
	var cfg Config
	switch ext := strings.ToLower(filepath.Ext(path)); ext {
	case ".yaml", ".yml":
		dec := yaml.NewDecoder(bytes.NewReader(b))
		if err := dec.Decode(&cfg); err != nil && !errors.Is(err, io.EOF) { // an empty file is an empty config
			return Config{}, fmt.Errorf("%s: %w", path, err)
		}
	case ".json":
		if err := json.Unmarshal(b, &cfg); err != nil {
			return Config{}, fmt.Errorf("%s: %w", path, err)
		}
	default:
		return Config{}, fmt.Errorf("outbox config: %s: want a .yaml, .yml or .json file (got %q)", path, ext)
	}
	if err := cfg.WithDefaults().Validate(); err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}
