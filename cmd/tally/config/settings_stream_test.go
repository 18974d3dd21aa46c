package config_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/outbox"
)

func TestStreamSettingsRefuseWhatCouldNotWork(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env     map[string]string
		args    []string
		wantErr string
	}{
		{map[string]string{"TALLY_STREAM_WORKERS": "0"}, nil, "TALLY_STREAM_WORKERS must be at least 1, got 0"},
		{map[string]string{"TALLY_STREAM_WORKERS": "-2"}, nil, "TALLY_STREAM_WORKERS must be at least 1, got -2"},
		{map[string]string{"TALLY_STREAM_WORKERS": "two"}, nil, `TALLY_STREAM_WORKERS: not a whole number: "two"`},
		{nil, []string{"--stream-workers", "0"}, "TALLY_STREAM_WORKERS must be at least 1"},
		{map[string]string{"TALLY_STREAM_BATCH": "0"}, nil, "TALLY_STREAM_BATCH must be 1 to 1000 (the most one claim may take), got 0"},
		{map[string]string{"TALLY_STREAM_BATCH": "1001"}, nil, "TALLY_STREAM_BATCH must be 1 to 1000 (the most one claim may take), got 1001"},
		{nil, []string{"--stream-batch", "5000"}, "TALLY_STREAM_BATCH must be 1 to 1000"},
		{map[string]string{"TALLY_STREAM_RECORD_BATCH": "0"}, nil, "TALLY_STREAM_RECORD_BATCH must be 1 to 10000, got 0"},
		{map[string]string{"TALLY_STREAM_RECORD_BATCH": "10001"}, nil, "TALLY_STREAM_RECORD_BATCH must be 1 to 10000, got 10001"},
		{nil, []string{"--stream-record-batch", "1e3"}, `--stream-record-batch: not a whole number: "1e3"`},
		{map[string]string{"TALLY_STREAM_RECORDERS": "0"}, nil, "TALLY_STREAM_RECORDERS must be 1 to 8, got 0"},
		{nil, []string{"--stream-recorders", "9"}, "TALLY_STREAM_RECORDERS must be 1 to 8, got 9"},
	} {
		_, err := load(t, tc.env, tc.args...)
		require.ErrorContains(t, err, tc.wantErr, "%v %v", tc.env, tc.args)
	}
	// Every problem at once, beside the delivery group's.
	_, err := load(t, map[string]string{"TALLY_STREAM_WORKERS": "0", "TALLY_STREAM_BATCH": "0", "TALLY_DELIVERY_WORKERS": "0"})
	require.ErrorContains(t, err, "TALLY_STREAM_WORKERS must be")
	require.ErrorContains(t, err, "TALLY_STREAM_BATCH must be")
	require.ErrorContains(t, err, "TALLY_DELIVERY_WORKERS and TALLY_DELIVERY_INFLIGHT must be at least 1")
}

func TestStreamSettingsDefaultThenEnvThenFlag(t *testing.T) {
	t.Parallel()
	c, err := load(t, nil)
	require.NoError(t, err)
	require.Equal(t, config.StreamConfig{Workers: exporter.DefaultStreamWorkers, Batch: exporter.DefaultStreamBatch,
		RecordBatch: exporter.DefaultStreamRecordBatch, Recorders: exporter.DefaultStreamRecorders}, c.Stream)
	require.LessOrEqual(t, exporter.DefaultStreamBatch, outbox.MaxClaim, "the default claim is one the outbox takes")

	env := map[string]string{"TALLY_STREAM_WORKERS": "5", "TALLY_STREAM_BATCH": "700", "TALLY_STREAM_RECORD_BATCH": "200", "TALLY_STREAM_RECORDERS": "3"}
	c, err = load(t, env)
	require.NoError(t, err)
	require.Equal(t, config.StreamConfig{Workers: 5, Batch: 700, RecordBatch: 200, Recorders: 3}, c.Stream)

	c, err = load(t, env, "--stream-workers", "1", "--stream-batch", "1000", "--stream-record-batch", "2000", "--stream-recorders", "1")
	require.NoError(t, err)
	require.Equal(t, config.StreamConfig{Workers: 1, Batch: 1000, RecordBatch: 2000, Recorders: 1}, c.Stream)
}

// Each deliverer is sized by its own settings: TALLY_DELIVERY_* never size
// the stream's, TALLY_STREAM_* never v1's.
func TestDeliverersAreSizedByTheirOwnSettings(t *testing.T) {
	t.Parallel()
	c, err := load(t, map[string]string{
		"TALLY_DELIVERY_WORKERS": "7", "TALLY_DELIVERY_BATCH": "30", "TALLY_DELIVERY_INFLIGHT": "40",
		"TALLY_STREAM_WORKERS": "3", "TALLY_STREAM_BATCH": "600", "TALLY_STREAM_RECORD_BATCH": "900",
		"TALLY_STREAM_RECORDERS": "4", "TALLY_STREAM_INFLIGHT": "3000", "TALLY_POLL_INTERVAL": "250ms",
	})
	require.NoError(t, err)
	v1, stream := c.DelivererConfigs()
	require.Equal(t, exporter.DelivererConfig{Workers: 7, Batch: 30, InFlight: 40, Policy: outbox.PerKey,
		PollInterval: 250 * time.Millisecond}, v1)
	require.Equal(t, exporter.DelivererConfig{Workers: 3, Batch: 600, InFlight: 3000, RecordBatch: 900, Recorders: 4,
		Policy: outbox.BestEffort, PollInterval: 250 * time.Millisecond}, stream)

	c, err = load(t, nil)
	require.NoError(t, err)
	v1, stream = c.DelivererConfigs()
	require.Equal(t, exporter.DelivererConfig{Workers: exporter.DefaultWorkers, Batch: exporter.DefaultBatch,
		InFlight: exporter.DefaultInFlight, Policy: outbox.PerKey, PollInterval: exporter.DefaultPollInterval}, v1)
	require.Equal(t, exporter.DelivererConfig{Workers: exporter.DefaultStreamWorkers, Batch: exporter.DefaultStreamBatch,
		InFlight: exporter.DefaultStreamInFlight, RecordBatch: exporter.DefaultStreamRecordBatch, Recorders: exporter.DefaultStreamRecorders,
		Policy: outbox.BestEffort, PollInterval: exporter.DefaultPollInterval}, stream)

	// A stream claim takes no more than the events the node may have in
	// flight.
	c, err = load(t, map[string]string{"TALLY_STREAM_INFLIGHT": "300", "TALLY_STREAM_BATCH": "800"})
	require.NoError(t, err)
	_, stream = c.DelivererConfigs()
	require.Equal(t, 300, stream.Batch)
	require.Equal(t, 300, stream.InFlight)
}
