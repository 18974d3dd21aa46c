package config_test

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestQuotaSettingsRefuseWhatCouldNeverPass(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env     map[string]string
		wantErr string
	}{
		{map[string]string{"TALLY_INGEST_EVENTS_PER_SECOND": "-1"}, "must not be negative"},
		{map[string]string{"TALLY_INGEST_REQUESTS_PER_SECOND": "-0.5"}, "must not be negative"},
		{map[string]string{"TALLY_INGEST_MAX_EVENTS": "0"}, "TALLY_INGEST_MAX_EVENTS must be 1 to 10000"},
		{map[string]string{"TALLY_INGEST_MAX_EVENTS": "10001"}, "TALLY_INGEST_MAX_EVENTS must be 1 to 10000"},
		{map[string]string{"TALLY_INGEST_EVENTS_BURST": "9999"}, "TALLY_INGEST_EVENTS_BURST must be at least TALLY_INGEST_MAX_EVENTS (10000)"},
		{map[string]string{"TALLY_INGEST_MAX_EVENTS": "500", "TALLY_INGEST_EVENTS_BURST": "499"}, "at least TALLY_INGEST_MAX_EVENTS (500)"},
		{map[string]string{"TALLY_INGEST_MAX_QUARANTINED": "-1"}, "TALLY_INGEST_MAX_QUARANTINED must not be negative"},
		{map[string]string{"TALLY_INGEST_EVENTS_BURST": "many"}, "not a whole number"},
	} {
		_, err := load(t, tc.env)
		require.ErrorContains(t, err, tc.wantErr, "%v", tc.env)
	}
	for _, ok := range []map[string]string{
		{"TALLY_INGEST_EVENTS_PER_SECOND": "0", "TALLY_INGEST_EVENTS_BURST": "0"}, // no limit: no burst needed
		{"TALLY_INGEST_REQUESTS_PER_SECOND": "0", "TALLY_INGEST_MAX_QUARANTINED": "0"},
		{"TALLY_INGEST_MAX_EVENTS": "500", "TALLY_INGEST_EVENTS_BURST": "500", "TALLY_INGEST_EVENTS_PER_SECOND": "0.5"},
	} {
		c, err := load(t, ok)
		require.NoError(t, err, "%v", ok)
		require.GreaterOrEqual(t, c.Quota.Ingest.EventsPerSecond, 0.0)
	}
}
