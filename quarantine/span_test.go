package quarantine_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// The report reads a month's items as one range of ids when they lie close
// together, and one by one when other items lie between them (a month's
// stragglers, or another month's items in between): both ways give the
// whole month. Here the month's second item, a supplement, is made after
// 600 items of nobody's usage, so the month's two items span more than
// four times their number plus 256 ids and are read one by one.
func TestCompletenessReadsItemsFarApartOneByOne(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.Feature(t, "api", mappings.Sum, time.Hour)
	b.Tenant(t, "acme", nil)
	at := ago(3 * time.Hour)
	month := at.Format("2006-01")
	report := func() quarantine.Line {
		t.Helper()
		c, err := quarantine.CompletenessOf(b.Ctx, b.Pool, month, "acme")
		require.NoError(t, err)
		require.True(t, c.Holds, "%+v", c)
		require.Len(t, c.Lines, 1)
		return c.Lines[0]
	}

	b.MustIngest(t, ev("a", "acme", "api", 5, at))
	b.Pass(t)
	l := report()
	require.Equal(t, quarantine.Bucket{Events: 1, Value: quarantine.ValueOf(5)}, l.Ingested)
	require.Equal(t, quarantine.Bucket{Events: 1, Value: quarantine.ValueOf(5)}, l.Pending)

	filler := make([]outbox.NewItem, 600)
	for i := range filler {
		filler[i] = outbox.NewItem{
			Identity: outbox.Identity{TenantKey: "filler", SubjectKind: outbox.SubjectUsageWindow,
				SubjectRef: fmt.Sprintf("usage:filler:%d", i), Exporter: b.Target.Exporter,
				DestinationAccount: b.Target.Account, Mode: b.Target.Mode, MappingVersion: 1},
			Payload: outbox.Payload{Customer: "cus_filler", EventName: "api", Value: 1, Timestamp: at.Unix(),
				Feature: "api", Period: "2020-01-01T00:00:00Z"},
		}
	}
	require.NoError(t, pgx.BeginFunc(b.Ctx, b.Pool, func(tx pgx.Tx) error {
		_, err := b.Outbox.EnqueueBatch(b.Ctx, tx, filler)
		return err
	}))
	b.MustIngest(t, ev("b", "acme", "api", 6, at))
	b.Pass(t)
	var span, items int64
	require.NoError(t, b.Pool.QueryRow(b.Ctx, `SELECT max(item_id) - min(item_id), count(DISTINCT item_id) FROM usage_events`).Scan(&span, &items))
	require.EqualValues(t, 2, items, "the window's item and its supplement")
	require.Greater(t, span, 4*items+256, "the month's items are too far apart to be read as a range")

	l = report()
	require.Equal(t, quarantine.Bucket{Events: 2, Value: quarantine.ValueOf(11)}, l.Ingested)
	require.Equal(t, quarantine.Bucket{Events: 2, Value: quarantine.ValueOf(11)}, l.Pending)
	require.Zero(t, l.InconsistentItems)
}
