package main

import (
	"fmt"
	"strings"

	"fusion/outbox"
)

// appliedAllMigrations is what migrate prints after applying every migration to an empty
// database, whatever the build's SchemaVersion.
func appliedAllMigrations() string {
	var vs []string
	for _, m := range outbox.Migrations() {
		vs = append(vs, fmt.Sprint(m.Version))
	}
	return fmt.Sprintf("applied migrations %s; the schema is at version %d\n", strings.Join(vs, ", "), outbox.SchemaVersion)
}
