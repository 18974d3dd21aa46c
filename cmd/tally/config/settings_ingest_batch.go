package config

import (
	"fmt"
	"strconv"
	"time"

	"github.com/tallymeter/tally/meter"
)

// coalesceSettings are how concurrent small POST /v1/usage batches share
// transactions (meter.Coalescing).
func coalesceSettings() []setting {
	return []setting{
		{"TALLY_INGEST_COALESCE_WAIT", "ingest-coalesce-wait", "the most a small POST /v1/usage waits, once a commit slot is free, for as many others as recent shared transactions held, and never longer than a recent commit; 0: no wait",
			time.Duration(meter.DefaultCoalesceWait).String(), dur(func(c *Config) *time.Duration { return &c.Coalesce.Wait })},
		{"TALLY_INGEST_COALESCE_EVENTS", "ingest-coalesce-events", "the most events concurrent POST /v1/usage requests share a transaction with; a request with more than half as many has its own; 0: none shared",
			strconv.Itoa(meter.DefaultCoalesceEvents), integer(func(c *Config) *int { return &c.Coalesce.MaxEvents })},
		{"TALLY_INGEST_COALESCE_BYTES", "ingest-coalesce-bytes", "the most bytes of events (ids, tenants, features, 32 for the rest) one shared ingest transaction holds",
			strconv.Itoa(meter.DefaultCoalesceBytes), integer(func(c *Config) *int { return &c.Coalesce.MaxBytes })},
		{"TALLY_INGEST_COALESCE_COMMITS", "ingest-coalesce-commits", "how many shared ingest transactions are written at once",
			strconv.Itoa(meter.DefaultCoalesceCommits), integer(func(c *Config) *int { return &c.Coalesce.Commits })},
	}
}

// coalesceProblems are those of the coalescing settings.
func (c *Config) coalesceProblems() []error {
	var errs []error
	k := c.Coalesce
	if k.Wait < 0 || k.Wait > time.Second {
		errs = append(errs, fmt.Errorf("TALLY_INGEST_COALESCE_WAIT must be 0 to 1s, got %s", k.Wait))
	}
	if k.MaxEvents < 0 || k.MaxEvents > meter.MaxEvents {
		errs = append(errs, fmt.Errorf("TALLY_INGEST_COALESCE_EVENTS must be 0 to %d, got %d", meter.MaxEvents, k.MaxEvents))
	}
	if k.MaxBytes < 1 {
		errs = append(errs, fmt.Errorf("TALLY_INGEST_COALESCE_BYTES must be positive, got %d", k.MaxBytes))
	}
	if k.Commits < 1 {
		errs = append(errs, fmt.Errorf("TALLY_INGEST_COALESCE_COMMITS must be at least 1, got %d", k.Commits))
	}
	return errs
}
