package web_test

import (
	"testing"

	"fusion/outbox/internal/pgtest"
)

// The web tests run on throwaway databases, with the simulated processes, seeded events and
// bounds they share with the core's tests (internal/testkit), through the core's public API
// only.

func TestMain(m *testing.M) { pgtest.Main(m) }
