package outbox

import (
	"flag"
	"os"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the generated section of docs/outbox.md")

const (
	docsPath  = "../docs/outbox.md"
	beginMark = "<!-- BEGIN GENERATED: the SQL of each transition, from package outbox; `go test ./outbox -run TestDocsSQL -update` rewrites it -->"
	endMark   = "<!-- END GENERATED -->"
	colsSplit = "<every item column: b. for the body's, o. for the state's>"
)

// TestDocsSQL keeps docs/outbox.md true: its transition SQL is the SQL this
// package runs.
func TestDocsSQL(t *testing.T) {
	var b strings.Builder
	b.WriteString(beginMark + "\n")
	for _, s := range []struct{ title, sql string }{
		{"T0 / T0q — enqueue (in the caller's transaction)", sqlEnqueue},
		{"T0, on conflict — the existing row (a second statement, so that it sees a row committed while the insert waited)", sqlEnqueueExisting},
		{"T0 / T0q for a batch (per-event items)", sqlEnqueueBatch},
		{"T1 — claim, BestEffort (BEGIN, the statement and COMMIT go in one round trip)", sqlClaimBestEffort},
		{"T1 — claim, PerKey, first try: one statement (BEGIN, the statement and COMMIT go in one round trip)", sqlClaimPerKeyOne},
		{"T1 — claim, PerKey, when the first try comes up short, step 1: candidate keys and an item of each, keys try-locked in order as they are found", sqlClaimKeys},
		{"T1 — claim, PerKey, step 1b: more candidate keys and items by a loose index scan (only when step 1 was cut off by a hot key)", sqlClaimKeysLoose},
		{"T1 — claim, PerKey, step 1c: try-lock the keys of step 1b", sqlClaimLockKeys},
		{"T1 — claim, PerKey, step 2: lease the chosen item of each locked key (a statement of its own: its snapshot follows the locks)", sqlClaimPerKey},
		{"T2 — accept", sqlAccept},
		{"T3 — retry (T4 when past the cap or the horizon)", sqlRetry},
		{"T4, T5, T6 — uncertain, rejected, quarantined", sqlSettleFailure},
		{"T4 — the maintenance sweep", sqlSweep},
		{"T7 — confirm", sqlConfirm},
		{"T8 — recover", sqlRecover},
		{"T9 — requeue", sqlRequeue},
		{"T9r — supersede (after the successor's T0, in the same transaction)", sqlSupersede},
		{"T10 — fail accepted (the provider's error report)", sqlFailAccepted},
		{"T11 — withdraw (a cancellation of usage none of whose attempts may have reached the provider)", sqlWithdraw},
		{"T11r — supersede a window's item without a cancelled event (after the successor's T0, in the same transaction)", sqlSupersedeCancelled},
		{"Cancellations lock the item that carries an event's usage now", sqlLockLive},
		{"The provider's error report on an item in flight — a note for its next T2", sqlNoteFailures},
		{"Park — no transition: a skipped key's due pending items move out of the claims' way, no attempt spent", sqlPark},
		{"Unpark — a key skipped no longer: its parked items are due at once", sqlUnpark},
		{"The gauge", sqlGauge},
		{"The gauge's watermark (a step per maintenance pass)", sqlGaugeAdvance},
	} {
		sql := strings.ReplaceAll(s.sql, splitColumns("b", "o"), colsSplit)
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
