// Package browsertest starts Debian's headless Chromium for tests that drive a real browser
// with chromedp. Each test gets a fresh browser with a fresh profile, stopped when the test
// ends. Without Chromium the test is skipped, or fails when CI=true (make deps installs it).
package browsertest

import (
	"context"
	"os"
	"os/exec"
	"sync"
	"testing"

	"github.com/chromedp/chromedp"
)

// Path is the Chromium executable: $CHROMIUM, /usr/bin/chromium, or the first of the usual
// names on PATH; empty when there is none.
func Path() string {
	if p := os.Getenv("CHROMIUM"); p != "" {
		return p
	}
	if _, err := os.Stat("/usr/bin/chromium"); err == nil {
		return "/usr/bin/chromium"
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	return ""
}

// New starts a headless Chromium and returns a chromedp context on its first tab. What the
// page writes to its console is logged when the test fails.
func New(t testing.TB) context.Context {
	t.Helper()
	path := Path()
	if path == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("browsertest: CI=true and no Chromium: install it (apt-get install chromium, or make deps)")
		}
		t.Skip("browsertest: no Chromium (apt-get install chromium, or make deps); set CI=true to make this a failure")
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		chromedp.NoSandbox, // tests run as root, where Chromium's sandbox refuses to start
		chromedp.DisableGPU,
		// The machine may have no network: every background fetch would only fail, and
		// flood the log with refused connections.
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("no-first-run", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1400, 1000),
	)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	// The first action starts the browser and binds it to ctx, which lives as long as the test.
	if err := chromedp.Do(ctx); err != nil {
		cancel()
		cancelAlloc()
		t.Fatalf("browsertest: start %s: %v", path, err)
	}
	var mu sync.Mutex
	var console []string
	done := make(chan struct{})
	messages := chromedp.Console(ctx)
	go func() {
		defer close(done)
		for m, err := range messages {
			if err != nil {
				return
			}
			mu.Lock()
			console = append(console, m.String())
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		cancel()
		cancelAlloc()
		<-done
		if t.Failed() {
			mu.Lock()
			defer mu.Unlock()
			for _, m := range console {
				t.Logf("browser console: %s", m)
			}
		}
	})
	return ctx
}
