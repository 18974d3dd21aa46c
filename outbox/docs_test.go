package outbox

import (
	"flag"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the generated sections of docs/outbox.md")

const (
	docsPath  = "../docs/outbox.md"
	endMark   = "<!-- END GENERATED -->"
	colsSplit = "<every item column: b. for the body's, o. for the state's>"
)

// The generated sections' first lines.
const (
	sqlMark         = "<!-- BEGIN GENERATED: the SQL of each transition, from package outbox; `go test ./outbox -run TestDocsSQL -update` rewrites it -->"
	transitionsMark = "<!-- BEGIN GENERATED: the state diagram and the transitions, from outbox.Transitions; `go test ./outbox -run TestDocsTransitions -update` rewrites it -->"
)

// specNumbers are the rule numbers of the original state machine's
// specification, kept in docs/outbox.md's table only, beside the names:
// the seeds and older notes cite them.
var specNumbers = map[Transition]string{
	TransitionStage:              "T0",
	TransitionStageQuarantined:   "T0q",
	TransitionStageWithdrawn:     "T0w",
	TransitionClaim:              "T1",
	TransitionAccept:             "T2",
	TransitionRetry:              "T3",
	TransitionMarkUncertain:      "T4",
	TransitionSweep:              "T4 (sweep)",
	TransitionReject:             "T5",
	TransitionQuarantine:         "T6",
	TransitionConfirm:            "T7",
	TransitionRecover:            "T8",
	TransitionRequeue:            "T9",
	TransitionSupersede:          "T9r",
	TransitionFailAccepted:       "T10",
	TransitionWithdraw:           "T11",
	TransitionSupersedeCancelled: "T11r",
}

// transitionSQL names the SQL constants of each transition, as the section
// "The SQL of each transition" shows them.
var transitionSQL = map[Transition][]string{
	TransitionStage:              {"sqlEnqueue", "sqlEnqueueExisting", "sqlEnqueueBatch", "sqlEnqueueBodies", "sqlEnqueueStates"},
	TransitionStageQuarantined:   {"sqlEnqueue", "sqlEnqueueBatch", "sqlEnqueueBodies", "sqlEnqueueStates"},
	TransitionStageWithdrawn:     {"sqlEnqueue", "sqlEnqueueBodies", "sqlEnqueueStates"},
	TransitionClaim:              {"sqlClaimBestEffort", "sqlClaimPerKeyOne", "sqlClaimKeys", "sqlClaimKeysLoose", "sqlClaimLockKeys", "sqlClaimPerKey"},
	TransitionAccept:             {"sqlAccept"},
	TransitionRetry:              {"sqlRetry"},
	TransitionMarkUncertain:      {"sqlSettleFailure", "sqlRetry"},
	TransitionSweep:              {"sqlSweep"},
	TransitionReject:             {"sqlSettleFailure"},
	TransitionQuarantine:         {"sqlSettleFailure"},
	TransitionConfirm:            {"sqlConfirm"},
	TransitionRecover:            {"sqlRecoverAccepted", "sqlRecoverPending", "sqlRecoverRejected"},
	TransitionRequeue:            {"sqlRequeue"},
	TransitionSupersede:          {"sqlSupersede"},
	TransitionFailAccepted:       {"sqlFailAccepted"},
	TransitionWithdraw:           {"sqlWithdraw"},
	TransitionSupersedeCancelled: {"sqlSupersedeCancelled"},
}

// transitionDoors says who runs each transition: the door (an HTTP route,
// a command, the console) or the service of `tally serve`.
var transitionDoors = map[Transition]string{
	TransitionStage:              "the stager, after `POST /v1/usage` or `tally import`",
	TransitionStageQuarantined:   "the stager, after `POST /v1/usage` or `tally import`",
	TransitionStageWithdrawn:     "`POST /v1/usage/cancellations`, `tally cancel`",
	TransitionClaim:              "the deliverer",
	TransitionAccept:             "the deliverer",
	TransitionRetry:              "the deliverer",
	TransitionMarkUncertain:      "the deliverer",
	TransitionSweep:              "the maintenance pass",
	TransitionReject:             "the deliverer",
	TransitionQuarantine:         "the deliverer",
	TransitionConfirm:            "the reconciler (`POST /v1/reconcile/runs`, `tally reconcile`); resolving a discrepancy (`POST /v1/reconcile/discrepancies/{id}/resolve`, the console, `tally reconcile resolve`)",
	TransitionRecover:            "`POST /v1/outbox/items/{id}/recover`, the console, `tally recover`",
	TransitionRequeue:            "`POST /v1/outbox/items/{id}/requeue`, `POST /v1/quarantine/requeue`, the console, `tally requeue`",
	TransitionSupersede:          "`POST /v1/outbox/items/{id}/requeue`, `POST /v1/quarantine/requeue`, the console, `tally requeue`",
	TransitionFailAccepted:       "Stripe's error report, `POST /v1/stripe/events`",
	TransitionWithdraw:           "`POST /v1/usage/cancellations`, `tally cancel`",
	TransitionSupersedeCancelled: "`POST /v1/usage/cancellations`, `tally cancel`",
}

// TestDocsSQL keeps docs/outbox.md true: its transition SQL is the SQL this
// package runs.
func TestDocsSQL(t *testing.T) {
	var b strings.Builder
	b.WriteString(sqlMark + "\n")
	for _, s := range []struct{ title, sql string }{
		{"stage / stage_quarantined / stage_withdrawn — enqueue (in the caller's transaction)", sqlEnqueue},
		{"stage, on conflict — the existing row (a second statement, so that it sees a row committed while the insert waited)", sqlEnqueueExisting},
		{"stage / stage_quarantined for a batch (per-event items)", sqlEnqueueBatch},
		{"stage on a distributed database, per shard group: the bodies (after `SELECT pg_current_xact_id()` in the same round trip, as on one server)", sqlEnqueueBodies},
		{"stage on a distributed database, per shard group: the state rows of the bodies inserted", sqlEnqueueStates},
		{"claim, BestEffort (BEGIN, the statement and COMMIT go in one round trip)", sqlClaimBestEffort},
		{"claim, PerKey, first try: one statement (BEGIN, the statement and COMMIT go in one round trip)", sqlClaimPerKeyOne},
		{"claim, PerKey, when the first try comes up short, step 1: candidate keys and an item of each, keys try-locked in order as they are found", sqlClaimKeys},
		{"claim, PerKey, step 1b: more candidate keys and items by a loose index scan (only when step 1 was cut off by a hot key)", sqlClaimKeysLoose},
		{"claim, PerKey, step 1c: try-lock the keys of step 1b", sqlClaimLockKeys},
		{"claim, PerKey, step 2: lease the chosen item of each locked key (a statement of its own: its snapshot follows the locks)", sqlClaimPerKey},
		{"accept", sqlAccept},
		{"retry (mark_uncertain when past the cap or the horizon)", sqlRetry},
		{"mark_uncertain, reject, quarantine", sqlSettleFailure},
		{"accept, retry, mark_uncertain/reject/quarantine on one server: each writes its attempts' rows itself — accept", sqlAcceptOneServer},
		{"retry, on one server", sqlRetryOneServer},
		{"mark_uncertain, reject, quarantine, on one server", sqlSettleFailureOneServer},
		{"The attempts' rows on Citus — after accept, retry, mark_uncertain, reject or quarantine, and the sweep of an expired lease: a second statement in the same transaction, from the rows the first returned", sqlAttempts},
		{"sweep — the maintenance pass", sqlSweep},
		{"confirm", sqlConfirm},
		{"recover, to accepted", sqlRecoverAccepted},
		{"recover, to pending", sqlRecoverPending},
		{"recover, to rejected", sqlRecoverRejected},
		{"requeue", sqlRequeue},
		{"supersede (after the successor's stage, in the same transaction)", sqlSupersede},
		{"fail_accepted (the provider's error report)", sqlFailAccepted},
		{"withdraw (a cancellation of usage none of whose attempts may have reached the provider)", sqlWithdraw},
		{"supersede_cancelled — a window's item without a cancelled event (after the successor's stage, in the same transaction)", sqlSupersedeCancelled},
		{"Cancellations lock the item that carries an event's usage now", sqlLockLive},
		{"The provider's error report on an item in flight — a note for its next accept", sqlNoteFailures},
		{"Park — no transition: a skipped key's due pending items move out of the claims' way, no attempt spent", sqlPark},
		{"Unpark — a key skipped no longer: its parked items are due at once", sqlUnpark},
		{"Wake the deliverers — after a stage that inserted a pending item, a requeue, a recovery to pending; in the same transaction, once per statement", sqlNotify},
		{"The gauge", sqlGauge},
		{"The gauge's watermark: where it is (a step per maintenance pass)", sqlGaugeStep},
		{"The gauge's watermark: the items a promotion counts", sqlGaugeRange},
		{"The gauge's watermark: promote", sqlGaugePromote},
		{"The gauge's watermark: arm", sqlGaugeArm},
		{"The gauge's watermark: the next watermark", sqlGaugeNext},
		{"The gauge's watermark: pick", sqlGaugePick},
	} {
		sql := strings.ReplaceAll(s.sql, splitColumns("b", "o"), colsSplit)
		b.WriteString("\n#### " + s.title + "\n\n```sql\n" + strings.TrimSpace(sql) + "\n```\n")
	}
	b.WriteString("\n" + endMark)
	checkGenerated(t, sqlMark, b.String(), "TestDocsSQL")
}

// TestDocsTransitions keeps docs/outbox.md's state diagram and table of
// transitions true to Transitions, and Transitions complete: every
// Transition constant is in it once, and every state is on the diagram.
func TestDocsTransitions(t *testing.T) {
	seen := map[Transition]bool{}
	onDiagram := map[State]bool{}
	for _, e := range Transitions {
		if seen[e.Transition] {
			t.Errorf("%s is in Transitions twice", e.Transition)
		}
		seen[e.Transition] = true
		if specNumbers[e.Transition] == "" || transitionDoors[e.Transition] == "" || len(transitionSQL[e.Transition]) == 0 {
			t.Errorf("%s lacks its number, its doors or its SQL in docs_test.go", e.Transition)
		}
		for _, s := range slices.Concat(e.From, e.To) {
			onDiagram[s] = true
		}
	}
	for tr := range specNumbers {
		if !seen[tr] {
			t.Errorf("%s is not in Transitions", tr)
		}
	}
	for _, s := range States {
		if !onDiagram[s] {
			t.Errorf("state %s is on no transition", s)
		}
	}
	checkGenerated(t, transitionsMark, transitionsSection(), "TestDocsTransitions")
}

// transitionsSection renders Transitions as a Mermaid state diagram (one
// arrow per pair of states, labelled with every transition between them)
// and a table.
func transitionsSection() string {
	var b strings.Builder
	b.WriteString(transitionsMark + "\n\n```mermaid\nstateDiagram-v2\n")
	type pair struct{ from, to string }
	var pairs []pair
	labels := map[pair][]string{}
	leaves := map[State]bool{}
	for _, e := range Transitions {
		from := []string{"[*]"}
		if len(e.From) > 0 {
			from = nil
			for _, s := range e.From {
				from = append(from, string(s))
				leaves[s] = true
			}
		}
		for _, f := range from {
			for _, to := range e.To {
				p := pair{f, string(to)}
				if _, ok := labels[p]; !ok {
					pairs = append(pairs, p)
				}
				labels[p] = append(labels[p], string(e.Transition))
			}
		}
	}
	for _, p := range pairs {
		fmt.Fprintf(&b, "    %s --> %s: %s\n", p.from, p.to, strings.Join(labels[p], ", "))
	}
	for _, s := range States {
		if !leaves[s] {
			fmt.Fprintf(&b, "    %s --> [*]\n", s)
		}
	}
	b.WriteString("```\n\n")
	b.WriteString("| transition | spec rule | from → to | `Store` method | run by | SQL |\n|---|---|---|---|---|---|\n")
	for _, e := range Transitions {
		from := "none"
		if len(e.From) > 0 {
			from = joinStates(e.From)
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s → %s | %s | %s | `%s` |\n", e.Transition, specNumbers[e.Transition],
			from, joinStates(e.To), e.Method, transitionDoors[e.Transition], strings.Join(transitionSQL[e.Transition], "`, `"))
	}
	b.WriteString("\n" + endMark)
	return b.String()
}

func joinStates(states []State) string {
	s := make([]string, len(states))
	for i, st := range states {
		s[i] = string(st)
	}
	return strings.Join(s, ", ")
}

// checkGenerated compares the section of docs/outbox.md that starts with
// begin with want, and rewrites it under -update.
func checkGenerated(t *testing.T, begin, want, test string) {
	t.Helper()
	doc, err := os.ReadFile(docsPath)
	if err != nil {
		t.Fatal(err)
	}
	text := string(doc)
	i := strings.Index(text, begin)
	j := -1
	if i >= 0 {
		j = strings.Index(text[i:], endMark)
	}
	if i < 0 || j < 0 {
		t.Fatalf("%s lacks the generated-section markers %q", docsPath, begin)
	}
	j += i
	if text[i:j+len(endMark)] == want {
		return
	}
	if !*update {
		t.Fatalf("%s is out of date with package outbox; run: go test ./outbox -run %s -update", docsPath, test)
	}
	if err := os.WriteFile(docsPath, []byte(text[:i]+want+text[j+len(endMark):]), 0o644); err != nil {
		t.Fatal(err)
	}
}
