package api_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/meter"
)

// An event of a month archived and detached is refused period_closed, as
// is a re-post of one of its events without its timestamp (it would fall in
// the current month): 422, nothing of the batch stored.
func TestIngestOfADetachedMonthIsRefusedPeriodClosed(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	tok := h.as(h.token("ingest", auth.RoleIngest))
	now := time.Now().UTC()
	month := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC).AddDate(0, -3, 0)
	stamp := month.Add(50 * time.Hour).Format(time.RFC3339)
	resp := h.request(http.MethodPost, "/v1/usage", tok, batch(event{"id": "old", "tenant": "acme", "feature": "api", "value": 5, "timestamp": stamp}))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)

	_, err := meter.DetachMonth(h.ctx, h.pool, month, meter.DetachProof{
		Previous: meter.VerifiedPeriod{Period: month.AddDate(0, -1, 0)},
		Month:    meter.VerifiedPeriod{Period: month, MonthEvents: 1},
	}, "test")
	require.NoError(t, err)

	for name, ev := range map[string]event{
		"re-post":                   {"id": "old", "tenant": "acme", "feature": "api", "value": 5, "timestamp": stamp},
		"re-post without timestamp": {"id": "old", "tenant": "acme", "feature": "api", "value": 5},
		"new event of the month":    {"id": "late", "tenant": "acme", "feature": "api", "value": 1, "timestamp": stamp},
	} {
		resp := h.request(http.MethodPost, "/v1/usage", tok, batch(event{"id": "fresh-" + name, "tenant": "acme", "feature": "api", "value": 1}, ev))
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", name, resp)
		require.Equal(t, "invalid_batch", resp.errorCode(t))
		ps := resp.problems(t)
		require.Len(t, ps, 1, "%s: %s", name, resp)
		require.Equal(t, 1, *ps[0].Index, name)
		require.True(t, strings.HasPrefix(ps[0].Reason, "period_closed: "), "%s: %s", name, ps[0].Reason)
	}
	require.Zero(t, h.count("SELECT count(*) FROM usage_events"), "nothing of a refused batch is stored")
	resp = h.request(http.MethodPost, "/v1/usage", tok, batch(event{"id": "now", "tenant": "acme", "feature": "api", "value": 1}))
	require.Equal(t, http.StatusAccepted, resp.status, "%s", resp)
}
