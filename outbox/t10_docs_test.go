package outbox

import (
	"os"
	"strings"
	"testing"
)

// TestDocsT10SQL keeps the T10 statement in docs/outbox.md true. It sits
// after the generated section, which TestDocsSQL owns.
func TestDocsT10SQL(t *testing.T) {
	doc, err := os.ReadFile(docsPath)
	if err != nil {
		t.Fatal(err)
	}
	want := "#### T10 — fail accepted (the provider's error report)\n\n```sql\n" + strings.TrimSpace(sqlT10Fail) + "\n```\n"
	if !strings.Contains(string(doc), want) {
		t.Fatalf("%s lacks T10's SQL as package outbox runs it:\n%s", docsPath, want)
	}
}
