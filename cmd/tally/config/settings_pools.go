package config

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/tallymeter/tally/quarantine"
)

// The defaults of the node's connection pools, one per workload, and of the
// bounds on reads. They sum to 26 connections a node; the embedded
// cluster allows 200.
const (
	// DefaultPoolIngest sizes the pool of the API's writes: usage, mapping
	// changes, requeues (TALLY_POOL_INGEST).
	DefaultPoolIngest = 8
	// DefaultPoolExport sizes the pool of the deliverers, the outbox
	// maintenance pass and River's jobs (staging, reconciliation)
	// (TALLY_POOL_EXPORT).
	DefaultPoolExport = 8
	// DefaultPoolRiver sizes River's own pool: its leader election,
	// notifications, fetches and completions (TALLY_POOL_RIVER).
	DefaultPoolRiver = 4
	// DefaultPoolReads sizes the pool of the reports, the console and the
	// API's GETs (TALLY_POOL_READS).
	DefaultPoolReads = 6
	// DefaultReadTimeout is the statement timeout of the reads pool, the
	// shortest of the pools' (TALLY_READ_TIMEOUT).
	DefaultReadTimeout = 15 * time.Second
	// DefaultReadsPerToken is how many expensive reads (reports, their
	// console pages, reconcile listings) one token may have in flight
	// (TALLY_READS_PER_TOKEN).
	DefaultReadsPerToken = 2
	// DefaultReportMaxAge is how old a completeness report's snapshot may
	// be and still answer (TALLY_REPORT_MAX_AGE).
	DefaultReportMaxAge = time.Minute
	// minPoolRiver is the smallest River pool: its notifier holds one
	// connection for good, and its leader election needs another.
	minPoolRiver = 3
)

// PoolsConfig sizes the node's connection pools and bounds its reads.
type PoolsConfig struct {
	// Ingest, Export, River and Reads are the pools' sizes. Default to
	// DefaultPoolIngest, DefaultPoolExport, DefaultPoolRiver and
	// DefaultPoolReads.
	Ingest, Export, River, Reads int
	// ReadTimeout is the reads pool's statement timeout. Defaults to
	// DefaultReadTimeout.
	ReadTimeout time.Duration
	// ReadsPerToken bounds one token's expensive reads in flight. Defaults
	// to DefaultReadsPerToken.
	ReadsPerToken int
	// ReportMaxAge is how old a completeness snapshot may be and still
	// answer; zero computes for every request that finds no computation
	// running. Defaults to DefaultReportMaxAge.
	ReportMaxAge time.Duration
	// ReportTimeout is the statement timeout of a completeness
	// computation. Defaults to quarantine.DefaultReportTimeout.
	ReportTimeout time.Duration
}

// poolSettings size the connection pools of `tally serve`, one per
// workload, and bound the reads.
func poolSettings() []setting {
	return []setting{
		{"TALLY_POOL_INGEST", "pool-ingest", "connections of serve's pool for the API's writes (usage, mappings, requeues)", strconv.Itoa(DefaultPoolIngest),
			integer(func(c *Config) *int { return &c.Pools.Ingest })},
		{"TALLY_POOL_EXPORT", "pool-export", "connections of serve's pool for the deliverers, outbox maintenance, staging and reconciliation", strconv.Itoa(DefaultPoolExport),
			integer(func(c *Config) *int { return &c.Pools.Export })},
		{"TALLY_POOL_RIVER", "pool-river", "connections of River's own pool (leader election, notifications, job fetches); at least 3", strconv.Itoa(DefaultPoolRiver),
			integer(func(c *Config) *int { return &c.Pools.River })},
		{"TALLY_POOL_READS", "pool-reads", "connections of serve's pool for reports, the console and the API's GETs", strconv.Itoa(DefaultPoolReads),
			integer(func(c *Config) *int { return &c.Pools.Reads })},
		{"TALLY_READ_TIMEOUT", "read-timeout", "statement timeout of the reads pool: a report or page query running longer is cancelled", short(DefaultReadTimeout),
			dur(func(c *Config) *time.Duration { return &c.Pools.ReadTimeout })},
		{"TALLY_READS_PER_TOKEN", "reads-per-token", "expensive reads (reports, their console pages, reconcile listings) one token may have in flight; more answer 429", strconv.Itoa(DefaultReadsPerToken),
			integer(func(c *Config) *int { return &c.Pools.ReadsPerToken })},
		{"TALLY_REPORT_MAX_AGE", "report-max-age", "how old the completeness report's snapshot may be and still answer; older, one computation per month serves every request waiting (0: compute whenever none runs)", short(DefaultReportMaxAge),
			dur(func(c *Config) *time.Duration { return &c.Pools.ReportMaxAge })},
		{"TALLY_REPORT_TIMEOUT", "report-timeout", "statement timeout of a completeness computation, in place of the reads pool's: one computation per month serves every request waiting", short(quarantine.DefaultReportTimeout),
			dur(func(c *Config) *time.Duration { return &c.Pools.ReportTimeout })},
	}
}

// poolProblems are those of the pools' sizes and the reads' bounds.
func (c *Config) poolProblems() []error {
	var errs []error
	p := c.Pools
	if p.Ingest < 1 || p.Export < 1 || p.Reads < 1 {
		errs = append(errs, errors.New("TALLY_POOL_INGEST, TALLY_POOL_EXPORT and TALLY_POOL_READS must be at least 1"))
	}
	if p.River < minPoolRiver {
		errs = append(errs, fmt.Errorf("TALLY_POOL_RIVER must be at least %d, got %d", minPoolRiver, p.River))
	}
	if p.ReadTimeout <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_READ_TIMEOUT must be positive, got %s", p.ReadTimeout))
	}
	if p.ReportTimeout <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_REPORT_TIMEOUT must be positive, got %s", p.ReportTimeout))
	}
	if p.ReportMaxAge < 0 {
		errs = append(errs, fmt.Errorf("TALLY_REPORT_MAX_AGE must not be negative, got %s", p.ReportMaxAge))
	}
	if p.ReadsPerToken < 1 {
		errs = append(errs, fmt.Errorf("TALLY_READS_PER_TOKEN must be at least 1, got %d", p.ReadsPerToken))
	}
	return errs
}
