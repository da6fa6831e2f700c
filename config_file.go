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
	"regexp"
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
//
// No error repeats a value from the file, nor a parser's message that could quote one: a
// connection string under the wrong key would put its password in the logs. An error names
// the key (and in YAML the line) and what the key wants. An unknown key is named only when it
// looks like a key (lower case, digits and _). A file is read only up to MaxConfigFileBytes
// and a list is refused past MaxConfigListEntries entries before its entries are decoded, so
// a wrong or hostile file costs little memory.

// Limits of a configuration file.
const (
	// MaxConfigFileBytes is the largest file LoadConfigFile reads: 64 KiB, twenty times the
	// commented example (testdata/outbox.example.yaml).
	MaxConfigFileBytes = 64 << 10
	// MaxConfigListEntries is the most entries a list key (retry_schedule) may have, in a file,
	// in a host's own file that embeds a Config, or set in code (Validate).
	MaxConfigListEntries = 100
	// maxConfigErrors is the most errors one decode reports; the rest are counted.
	maxConfigErrors = 10
)

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

// decodeError names the file key whose value is bad. Its arguments never hold the value.
func decodeError(key, format string, args ...any) error {
	return &ValidationError{Field: key, Reason: fmt.Sprintf(format, args...)}
}

const wantDuration = `want a duration string such as "1s", "250ms" or "720h"`

var keyLike = regexp.MustCompile(`^[a-z][a-z0-9_]{0,63}$`)

// unknownKey is the error for a key Config does not have. A key that does not look like one
// is not repeated: it may be a value written where a key belongs.
func unknownKey(key, where string) error {
	if !keyLike.MatchString(key) {
		key = "(key not shown: it does not look like one)"
	}
	return decodeError(key, "%sis not a key of the outbox config (keys: %s)", where, strings.Join(ConfigKeys(), ", "))
}

// wantKind says what a key of type t wants, without Go's type names.
func wantKind(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Bool:
		return "want true or false"
	case reflect.Int, reflect.Int64, reflect.Int32:
		return "want an integer"
	case reflect.String:
		return "want a string"
	}
	return "want a value of type " + t.String()
}

// errorList collects a decode's errors up to maxConfigErrors.
type errorList struct {
	errs    []error
	dropped int
}

func (l *errorList) add(err error) {
	if len(l.errs) < maxConfigErrors {
		l.errs = append(l.errs, err)
		return
	}
	l.dropped++
}

func (l *errorList) full() bool { return len(l.errs) >= maxConfigErrors }

func (l *errorList) err() error {
	if len(l.errs) == 0 {
		return nil
	}
	errs := l.errs
	if l.dropped > 0 {
		errs = append(errs, fmt.Errorf("and %d more errors not shown", l.dropped))
	}
	return fmt.Errorf("outbox config: %w", errors.Join(errs...))
}

func parseDurationValue(s string) (time.Duration, bool) {
	d, err := time.ParseDuration(strings.TrimSpace(s))
	return d, err == nil
}

// decodeJSONStrings reads a JSON array of strings, refusing it past MaxConfigListEntries
// entries before it decodes more.
func decodeJSONStrings(key string, msg json.RawMessage) ([]string, error) {
	const want = `want a list of duration strings such as ["1s", "5s"]`
	dec := json.NewDecoder(bytes.NewReader(msg))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('[') {
		return nil, decodeError(key, want)
	}
	var ss []string
	for dec.More() {
		if len(ss) == MaxConfigListEntries {
			return nil, decodeError(key, "has more than %d entries, the limit (MaxConfigListEntries)", MaxConfigListEntries)
		}
		var s string
		if err := dec.Decode(&s); err != nil {
			return nil, decodeError(key, "entry %d: %s", len(ss), wantDuration)
		}
		ss = append(ss, s)
	}
	return ss, nil
}

// UnmarshalJSON decodes a JSON object with Config's keys into c, refusing unknown keys and
// reading durations from strings. Keys absent from the object keep c's values.
func (c *Config) UnmarshalJSON(b []byte) error {
	if bytes.Equal(bytes.TrimSpace(b), []byte("null")) {
		return nil
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return errors.New("outbox config: want an object of keys and values")
	}
	configKeysOnce.Do(loadConfigKeys)
	out := *c
	v := reflect.ValueOf(&out).Elem()
	var errs errorList
	for _, key := range sortedKeys(raw) {
		if errs.full() {
			errs.dropped++
			continue
		}
		msg := raw[key]
		k, ok := configKeys[key]
		if !ok {
			errs.add(unknownKey(key, ""))
			continue
		}
		fv := v.Field(k.index)
		switch k.typ {
		case durationType:
			var s string
			if err := json.Unmarshal(msg, &s); err != nil {
				errs.add(decodeError(key, wantDuration))
				continue
			}
			d, ok := parseDurationValue(s)
			if !ok {
				errs.add(decodeError(key, wantDuration))
				continue
			}
			fv.SetInt(int64(d))
		case durationsType:
			ss, err := decodeJSONStrings(key, msg)
			if err != nil {
				errs.add(err)
				continue
			}
			ds, err := parseDurations(key, ss)
			if err != nil {
				errs.add(err)
				continue
			}
			fv.Set(reflect.ValueOf(ds))
		default:
			dec := json.NewDecoder(bytes.NewReader(msg))
			dec.DisallowUnknownFields()
			if err := dec.Decode(fv.Addr().Interface()); err != nil {
				errs.add(decodeError(key, "%s", wantKind(k.typ)))
			}
		}
	}
	if err := errs.err(); err != nil {
		return err
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
	var errs errorList
	seen := map[string]bool{}
	bad := func(n *yaml.Node, key, format string, args ...any) {
		errs.add(decodeError(key, "line %d: "+format, append([]any{n.Line}, args...)...))
	}
	isString := func(n *yaml.Node) bool { return n.Kind == yaml.ScalarNode && n.Tag == "!!str" }
	for i := 0; i+1 < len(node.Content); i += 2 {
		if errs.full() {
			errs.dropped++
			continue
		}
		kn, vn := node.Content[i], node.Content[i+1]
		key := kn.Value
		if kn.Kind != yaml.ScalarNode {
			key = ""
		}
		k, ok := configKeys[key]
		if !ok {
			errs.add(unknownKey(key, fmt.Sprintf("line %d: ", kn.Line)))
			continue
		}
		if seen[key] {
			bad(kn, key, "is given twice")
			continue
		}
		seen[key] = true
		fv := v.Field(k.index)
		switch k.typ {
		case durationType:
			d, ok := parseDurationValue(vn.Value)
			if !isString(vn) || !ok {
				bad(vn, key, wantDuration)
				continue
			}
			fv.SetInt(int64(d))
		case durationsType:
			if vn.Kind != yaml.SequenceNode {
				bad(vn, key, "want a list of duration strings such as [1s, 5s]")
				continue
			}
			if len(vn.Content) > MaxConfigListEntries {
				bad(vn, key, "has more than %d entries, the limit (MaxConfigListEntries)", MaxConfigListEntries)
				continue
			}
			ss := make([]string, 0, len(vn.Content))
			for j, item := range vn.Content {
				if !isString(item) {
					bad(item, key, "entry %d: %s", j, wantDuration)
					break
				}
				ss = append(ss, item.Value)
			}
			if len(ss) < len(vn.Content) {
				continue
			}
			ds, err := parseDurations(key, ss)
			if err != nil {
				bad(vn, key, "%v", err.(*ValidationError).Reason)
				continue
			}
			fv.Set(reflect.ValueOf(ds))
		default:
			if vn.Kind != yaml.ScalarNode || vn.Decode(fv.Addr().Interface()) != nil {
				bad(vn, key, "%s", wantKind(k.typ))
			}
		}
	}
	if err := errs.err(); err != nil {
		return err
	}
	*c = out
	return nil
}

func parseDurations(key string, ss []string) ([]time.Duration, error) {
	ds := make([]time.Duration, 0, len(ss))
	for i, s := range ss {
		d, ok := parseDurationValue(s)
		if !ok {
			return nil, decodeError(key, "entry %d: %s", i, wantDuration)
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

// LoadConfigFile reads a Config from a .yaml, .yml or .json file of at most
// MaxConfigFileBytes and validates it (with the defaults applied), so that a bad file fails at
// load with the keys it uses. It returns the configuration as the file gave it: the
// constructors apply the defaults. Its errors name the file, the key and what the key wants,
// never a value from the file.
func LoadConfigFile(path string) (Config, error) {
	ext := strings.ToLower(filepath.Ext(path))
	if ext != ".yaml" && ext != ".yml" && ext != ".json" {
		return Config{}, fmt.Errorf("outbox config: %s: want a .yaml, .yml or .json file", path)
	}
	b, err := readConfigFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("outbox config: %w", err)
	}
	var cfg Config
	if ext == ".json" {
		if err := json.Unmarshal(b, &cfg); err != nil {
			return Config{}, fmt.Errorf("%s: %w", path, jsonFileError(b, err))
		}
	} else {
		dec := yaml.NewDecoder(bytes.NewReader(b))
		if err := dec.Decode(&cfg); err != nil && !errors.Is(err, io.EOF) { // an empty file is an empty config
			return Config{}, fmt.Errorf("%s: %w", path, yamlFileError(err))
		}
	}
	if err := cfg.WithDefaults().Validate(); err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}

// readConfigFile reads path, refusing it past MaxConfigFileBytes without reading further.
func readConfigFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxConfigFileBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if len(b) > MaxConfigFileBytes {
		return nil, fmt.Errorf("%s: the file is larger than %d bytes, the limit (MaxConfigFileBytes)", path, MaxConfigFileBytes)
	}
	return b, nil
}

// A parser's own message is kept only when it cannot hold a piece of the file: lower-case
// words, digits and punctuation, with nothing quoted but one punctuation mark (as in
// "did not find expected ':'"). Anything else (a quoted anchor or character, a backquoted
// value) gives way to a general description.
var (
	quotedMark   = regexp.MustCompile(`'[^A-Za-z0-9'\s]'`)
	plainMessage = regexp.MustCompile(`^[a-z0-9 ,;:()-]*$`)
	yamlLine     = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)
)

func parserMessage(msg string) (string, bool) {
	if len(msg) > 200 || !plainMessage.MatchString(quotedMark.ReplaceAllString(msg, "")) {
		return "", false
	}
	return msg, true
}

// yamlFileError is err from decoding a YAML file, with the parser's message only if it
// cannot quote the file. The decoder's own errors (ValidationError) pass as they are.
func yamlFileError(err error) error {
	var verr *ValidationError
	if errors.As(err, &verr) || strings.HasPrefix(err.Error(), "outbox config: ") {
		return err
	}
	where, msg := "", strings.TrimPrefix(err.Error(), "yaml: ")
	if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
		where, msg = "line "+m[1]+": ", m[2]
	}
	if text, ok := parserMessage(msg); ok {
		return fmt.Errorf("outbox config: %snot valid YAML: %s", where, text)
	}
	return fmt.Errorf("outbox config: %snot valid YAML (the parser's message is not shown: it quotes the file)", where)
}

// jsonFileError is err from decoding a JSON file, placed by line and column, with
// encoding/json's message only if it cannot quote the file.
func jsonFileError(b []byte, err error) error {
	var syn *json.SyntaxError
	if !errors.As(err, &syn) {
		if strings.HasPrefix(err.Error(), "outbox config: ") {
			return err
		}
		return errors.New("outbox config: want an object of keys and values")
	}
	// Offset counts the bytes read, the offending one included.
	off := min(max(int(syn.Offset)-1, 0), len(b))
	line := 1 + bytes.Count(b[:off], []byte("\n"))
	col := off - bytes.LastIndexByte(b[:off], '\n')
	if text, ok := parserMessage(syn.Error()); ok {
		return fmt.Errorf("outbox config: line %d, column %d: not valid JSON: %s", line, col, text)
	}
	return fmt.Errorf("outbox config: line %d, column %d: not valid JSON", line, col)
}
