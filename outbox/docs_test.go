package outbox

import (
	"flag"
	"os"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the generated section of docs/outbox.md")

const (
	docsPath   = "../docs/outbox.md"
	beginMark  = "<!-- BEGIN GENERATED: the SQL of each transition, from package outbox; `go test ./outbox -run TestDocsSQL -update` rewrites it -->"
	endMark    = "<!-- END GENERATED -->"
	colsPlain  = "<every item column>"
	colsPrefix = "o.<every item column>"
)

// TestDocsSQL keeps docs/outbox.md true: its transition SQL is the SQL this
// package runs.
func TestDocsSQL(t *testing.T) {
	var b strings.Builder
	b.WriteString(beginMark + "\n")
	for _, s := range []struct{ title, sql string }{
		{"T0 / T0q — enqueue (in the caller's transaction)", sqlT0Enqueue},
		{"T0, on conflict — the existing row (a second statement, so that it sees a row committed while the insert waited)", sqlT0Existing},
		{"T0 / T0q for a batch (per-event items)", sqlT0EnqueueBatch},
		{"T1 — claim, BestEffort", sqlT1BestEffort},
		{"T1 — claim, PerKey, step 1: candidate keys", sqlT1Keys},
		{"T1 — claim, PerKey, step 1b: candidate keys by a loose index scan (only when step 1 was cut off by a hot key)", sqlT1KeysLoose},
		{"T1 — claim, PerKey, step 2: try-lock keys", sqlT1LockKeys},
		{"T1 — claim, PerKey, step 3: lease one item per locked key", sqlT1PerKey},
		{"T2 — accept", sqlT2Accept},
		{"T3 — retry (T4 when past the cap or the horizon)", sqlT3Retry},
		{"T4, T5, T6 — uncertain, rejected, quarantined", sqlT4T5T6},
		{"T4 — the maintenance sweep", sqlT4Sweep},
		{"T7 — confirm", sqlT7Confirm},
		{"T8 — recover", sqlT8Recover},
		{"T9 — requeue", sqlT9Requeue},
		{"T9r — supersede (after the successor's T0, in the same transaction)", sqlT9rSupersede},
		{"T10 — fail accepted (the provider's error report)", sqlT10Fail},
		{"The provider's error report on an item in flight — a note for its next T2", sqlNoteFailures},
		{"The gauge", sqlGauge},
	} {
		sql := strings.ReplaceAll(s.sql, columns("o"), colsPrefix)
		sql = strings.ReplaceAll(sql, columns(""), colsPlain)
		b.WriteString("\n#### " + s.title + "\n\n```sql\n" + strings.TrimSpace(sql) + "\n```\n")
	}
	b.WriteString("\n" + endMark)
	want := b.String()

	doc, err := os.ReadFile(docsPath)
	if err != nil {
		t.Fatal(err)
	}
	text := string(doc)
	i, j := strings.Index(text, beginMark), strings.Index(text, endMark)
	if i < 0 || j < i {
		t.Fatalf("%s lacks the generated-section markers", docsPath)
	}
	got := text[i : j+len(endMark)]
	if got == want {
		return
	}
	if !*update {
		t.Fatalf("%s is out of date with the SQL of package outbox; run: go test ./outbox -run TestDocsSQL -update", docsPath)
	}
	if err := os.WriteFile(docsPath, []byte(text[:i]+want+text[j+len(endMark):]), 0o644); err != nil {
		t.Fatal(err)
	}
}
