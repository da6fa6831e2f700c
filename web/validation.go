package web

import (
	"fmt"

	"fusion/outbox"
)

// invalid is bad input to one of the package's constructors: the same *outbox.ValidationError
// the core returns for its own options, naming the field and what is wrong with it.
func invalid(field, format string, args ...any) error {
	return &outbox.ValidationError{Field: field, Reason: fmt.Sprintf(format, args...)}
}
