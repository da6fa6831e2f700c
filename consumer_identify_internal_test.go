package outbox

import (
	"reflect"
	"strings"
	"testing"
	"unsafe"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestIdentifyReachesEveryPart: New builds a consumer before its identity is known, and Start
// identifies it. Every part reachable from the consumer must then carry the identity, the
// owner token and a logger that names the identity: a part added to newConsumer and forgotten
// in identify would act as the empty identity.
func TestIdentifyReachesEveryPart(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(t.Context(), "postgres://localhost:1/none") // never connects
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	core, logs := observer.New(zap.InfoLevel)
	c, err := newConsumer(ConsumerOptions{Pool: pool, Projects: StaticProjects{"p"},
		Dispatcher: NewDispatcher(DispatcherOptions{}), Logger: zap.New(core)}, Config{}.WithDefaults().consumerConfig())
	if err != nil {
		t.Fatal(err)
	}
	c.identify("before")
	c.identify("c9") // Start identifies again after a failed start: the last one counts

	var ids, owners, loggers int
	seen := map[uintptr]bool{}
	var walk func(v reflect.Value, path string)
	walk = func(v reflect.Value, path string) {
		switch v.Kind() {
		case reflect.Pointer:
			if l, ok := v.Interface().(*zap.Logger); ok {
				if l == nil {
					t.Errorf("%s is a nil logger", path)
					return
				}
				loggers++
				l.Info("probe", zap.String("path", path))
				return
			}
			if v.IsNil() || seen[v.Pointer()] {
				return
			}
			seen[v.Pointer()] = true
			if v.Elem().Kind() == reflect.Struct && v.Elem().Type().PkgPath() == reflect.TypeFor[Consumer]().PkgPath() &&
				v.Type() != reflect.TypeFor[*Dispatcher]() && v.Type() != reflect.TypeFor[*Metrics]() {
				walk(v.Elem(), path)
			}
		case reflect.Struct:
			for i := range v.NumField() {
				f := v.Field(i)
				f = reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem()
				name := path + "." + v.Type().Field(i).Name
				switch {
				case f.Type() == reflect.TypeFor[ConsumerID]():
					ids++
					if f.String() != "c9" {
						t.Errorf("%s is %q, not the identity", name, f.String())
					}
				case v.Type().Field(i).Name == "owner" && f.Kind() == reflect.String:
					owners++
					if !strings.HasPrefix(f.String(), "c9@") {
						t.Errorf("%s is %q, not the identity's owner token", name, f.String())
					}
				default:
					walk(f, name)
				}
			}
		}
	}
	walk(reflect.ValueOf(c), "Consumer")
	if ids < 7 || owners < 3 || loggers < 6 {
		t.Fatalf("the walk found %d identities, %d owner tokens, %d loggers: fewer than the parts have", ids, owners, loggers)
	}
	for _, e := range logs.FilterMessage("probe").All() {
		path := e.ContextMap()["path"]
		if path == "Consumer.baseLog" {
			continue // the logger identify starts from
		}
		if got := e.ContextMap()["consumer_id"]; got != "c9" {
			t.Errorf("the logger at %s names consumer %v", path, got)
		}
	}
}
