package config

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/meter"
)

// QuotaConfig bounds what one token may post to POST /v1/usage
// (TALLY_INGEST_…).
type QuotaConfig struct {
	// Ingest are the per-token rate limits of one node and the most events
	// of a request. Default to api's DefaultIngest… constants and
	// meter.MaxEvents.
	Ingest api.IngestQuota
	// MaxQuarantined is the most quarantined items one request may make; 0
	// is no cap. Defaults to meter.DefaultMaxQuarantined.
	MaxQuarantined int
}

// quotaSettings are the ingest quotas.
func quotaSettings() []setting {
	return []setting{
		{"TALLY_INGEST_EVENTS_PER_SECOND", "ingest-events-per-second", "usage events a second one token may post to this node; 0: no limit", strconv.Itoa(api.DefaultIngestEventsPerSecond),
			float(func(c *Config) *float64 { return &c.Quota.Ingest.EventsPerSecond })},
		{"TALLY_INGEST_EVENTS_BURST", "ingest-events-burst", "events one token may post at once above that rate; at least TALLY_INGEST_MAX_EVENTS", strconv.Itoa(api.DefaultIngestEventsBurst),
			integer(func(c *Config) *int { return &c.Quota.Ingest.EventsBurst })},
		{"TALLY_INGEST_REQUESTS_PER_SECOND", "ingest-requests-per-second", "POST /v1/usage requests a second one token may make to this node; 0: no limit", strconv.Itoa(api.DefaultIngestRequestsPerSecond),
			float(func(c *Config) *float64 { return &c.Quota.Ingest.RequestsPerSecond })},
		{"TALLY_INGEST_MAX_EVENTS", "ingest-max-events", fmt.Sprintf("the most events one POST /v1/usage may carry, 1 to %d", meter.MaxEvents), strconv.Itoa(meter.MaxEvents),
			integer(func(c *Config) *int { return &c.Quota.Ingest.MaxEvents })},
		{"TALLY_INGEST_MAX_QUARANTINED", "ingest-max-quarantined", "the most quarantined items the new events of one POST /v1/usage may make; 0: no cap", strconv.Itoa(meter.DefaultMaxQuarantined),
			integer(func(c *Config) *int { return &c.Quota.MaxQuarantined })},
	}
}

// quotaProblems are those of the ingest quotas.
func (c *Config) quotaProblems() []error {
	q := c.Quota.Ingest
	var errs []error
	if q.EventsPerSecond < 0 || q.RequestsPerSecond < 0 {
		errs = append(errs, errors.New("TALLY_INGEST_EVENTS_PER_SECOND and TALLY_INGEST_REQUESTS_PER_SECOND must not be negative (0: no limit)"))
	}
	if q.MaxEvents < 1 || q.MaxEvents > meter.MaxEvents {
		errs = append(errs, fmt.Errorf("TALLY_INGEST_MAX_EVENTS must be 1 to %d, got %d", meter.MaxEvents, q.MaxEvents))
	}
	if q.EventsPerSecond > 0 && q.EventsBurst < q.MaxEvents {
		errs = append(errs, fmt.Errorf("TALLY_INGEST_EVENTS_BURST must be at least TALLY_INGEST_MAX_EVENTS (%d), or a full batch could never pass; got %d",
			q.MaxEvents, q.EventsBurst))
	}
	if c.Quota.MaxQuarantined < 0 {
		errs = append(errs, fmt.Errorf("TALLY_INGEST_MAX_QUARANTINED must not be negative (0: no cap), got %d", c.Quota.MaxQuarantined))
	}
	return errs
}
