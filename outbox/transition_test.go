package outbox_test

import (
	"context"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/testkit/testdb"
	"github.com/tallymeter/tally/outbox"
)

// TestTransitionsAreTheDatabaseEdges holds outbox.Transitions, the table
// docs/outbox.md's diagram is drawn from, to the database's edge trigger:
// every change of state a transition makes is an edge the trigger admits,
// and the trigger admits no edge that no transition makes.
func TestTransitionsAreTheDatabaseEdges(t *testing.T) {
	t.Parallel()
	pool := testdb.New(t)
	var def string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT pg_get_triggerdef(oid) FROM pg_trigger
		WHERE tgrelid = 'outbox_item_states'::regclass AND tgname = 'outbox_item_states_edges'`).Scan(&def))

	admitted := map[[2]outbox.State]bool{}
	for _, m := range regexp.MustCompile(`\(old\.state <> '(\w+)'::text\) OR \(new\.state <> '(\w+)'::text\)`).FindAllStringSubmatch(def, -1) {
		admitted[[2]outbox.State{outbox.State(m[1]), outbox.State(m[2])}] = true
	}
	require.NotEmpty(t, admitted, "no edge read from %s", def)

	made := map[[2]outbox.State]bool{}
	for _, e := range outbox.Transitions {
		for _, from := range e.From {
			for _, to := range e.To {
				if from != to {
					made[[2]outbox.State{from, to}] = true
				}
			}
		}
	}
	require.Equal(t, admitted, made)
}
