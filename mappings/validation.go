package mappings

import (
	"regexp"
	"strings"
)

// FieldError is one problem with an input: a field and why, for a 422
// answer.
type FieldError struct {
	Field  string `json:"field"`
	Reason string `json:"reason"`
}

// ValidationError lists every problem with an input.
type ValidationError struct {
	Fields []FieldError
}

func (e *ValidationError) Error() string {
	parts := make([]string, len(e.Fields))
	for i, f := range e.Fields {
		parts[i] = f.Field + ": " + f.Reason
	}
	return "mappings: invalid input: " + strings.Join(parts, "; ")
}

// Names of features and tenants: a letter or digit, then up to 63 of
// letters, digits and _.:- (the same rule as the ledger's).
var namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$`)

// ValidName reports whether s is a valid feature or tenant name.
func ValidName(s string) bool { return namePattern.MatchString(s) }

var eventNamePattern = regexp.MustCompile(`^[A-Za-z0-9_.:-]{1,100}$`)
