package config

import (
	"fmt"
	"strconv"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/outbox"
)

// StreamConfig sizes the v2 meter event stream's deliverer where it differs
// from v1's (TALLY_DELIVERY_WORKERS and TALLY_DELIVERY_BATCH size v1's
// alone): fewer claim loops, each claiming many more items, and outcomes
// written a claim's worth at a time. Its events in flight are
// TALLY_STREAM_INFLIGHT (Config.StreamInFlight).
type StreamConfig struct {
	// Workers is how many claim loops the stream's deliverer runs.
	// Defaults to exporter.DefaultStreamWorkers.
	Workers int
	// Batch is the most items one of its claims takes, 1 to
	// outbox.MaxClaim. Defaults to exporter.DefaultStreamBatch.
	Batch int
	// RecordBatch is the most of its outcomes written in one transaction.
	// Defaults to exporter.DefaultStreamRecordBatch.
	RecordBatch int
	// Recorders is how many batches of its outcomes are written at once,
	// each on a connection of the export pool, 1 to maxStreamRecorders.
	// Defaults to exporter.DefaultStreamRecorders.
	Recorders int
}

// maxStreamRecordBatch bounds TALLY_STREAM_RECORD_BATCH: outcomes are
// written in one transaction that first locks every row of the batch, so
// ten claims' worth is already more than a claim loop ever waits for.
const maxStreamRecordBatch = 10 * outbox.MaxClaim

// maxStreamRecorders bounds TALLY_STREAM_RECORDERS: each writes on a
// connection of the export pool (TALLY_POOL_EXPORT, 8), which the claim
// loops, staging and reconciliation share.
const maxStreamRecorders = 8

// streamSettings size the v2 stream's deliverer (StreamConfig).
func streamSettings() []setting {
	return []setting{
		{"TALLY_STREAM_WORKERS", "stream-workers", "the v2 stream deliverer's claim loops on this node", strconv.Itoa(exporter.DefaultStreamWorkers),
			integer(func(c *Config) *int { return &c.Stream.Workers })},
		{"TALLY_STREAM_BATCH", "stream-batch", fmt.Sprintf("the most items one claim of the v2 stream's deliverer takes, 1 to %d", outbox.MaxClaim),
			strconv.Itoa(exporter.DefaultStreamBatch), integer(func(c *Config) *int { return &c.Stream.Batch })},
		{"TALLY_STREAM_RECORD_BATCH", "stream-record-batch", "the most outcomes of the v2 stream's deliverer written in one transaction", strconv.Itoa(exporter.DefaultStreamRecordBatch),
			integer(func(c *Config) *int { return &c.Stream.RecordBatch })},
		{"TALLY_STREAM_RECORDERS", "stream-recorders", fmt.Sprintf("how many batches of the v2 stream's outcomes are written at once, 1 to %d", maxStreamRecorders),
			strconv.Itoa(exporter.DefaultStreamRecorders), integer(func(c *Config) *int { return &c.Stream.Recorders })},
	}
}

// streamProblems are those of the stream deliverer's sizes.
func (c *Config) streamProblems() []error {
	var errs []error
	s := c.Stream
	if s.Workers < 1 {
		errs = append(errs, fmt.Errorf("TALLY_STREAM_WORKERS must be at least 1, got %d", s.Workers))
	}
	if s.Batch < 1 || s.Batch > outbox.MaxClaim {
		errs = append(errs, fmt.Errorf("TALLY_STREAM_BATCH must be 1 to %d (the most one claim may take), got %d", outbox.MaxClaim, s.Batch))
	}
	if s.RecordBatch < 1 || s.RecordBatch > maxStreamRecordBatch {
		errs = append(errs, fmt.Errorf("TALLY_STREAM_RECORD_BATCH must be 1 to %d, got %d", maxStreamRecordBatch, s.RecordBatch))
	}
	if s.Recorders < 1 || s.Recorders > maxStreamRecorders {
		errs = append(errs, fmt.Errorf("TALLY_STREAM_RECORDERS must be 1 to %d, got %d", maxStreamRecorders, s.Recorders))
	}
	return errs
}

// DelivererConfigs are the two deliverers' knobs from the configuration:
// v1's from TALLY_DELIVERY_WORKERS, _BATCH and _INFLIGHT, claiming per key;
// the v2 stream's from TALLY_STREAM_WORKERS, _BATCH, _RECORD_BATCH,
// _RECORDERS and _INFLIGHT, claiming regardless of key (the stream has no per-key rule).
// A stream claim takes no more than its events in flight. Both poll every
// TALLY_POLL_INTERVAL. The caller adds what is not configuration
// (KeyHealth).
func (c Config) DelivererConfigs() (v1, stream exporter.DelivererConfig) {
	v1 = exporter.DelivererConfig{
		Workers: c.DeliveryWorkers, Batch: c.DeliveryBatch, InFlight: c.DeliveryInFlight,
		Policy: outbox.PerKey, PollInterval: c.PollInterval,
	}
	stream = exporter.DelivererConfig{
		Workers: c.Stream.Workers, Batch: min(c.Stream.Batch, c.StreamInFlight), InFlight: c.StreamInFlight,
		RecordBatch: c.Stream.RecordBatch, Recorders: c.Stream.Recorders, Policy: outbox.BestEffort, PollInterval: c.PollInterval,
	}
	return v1, stream
}
