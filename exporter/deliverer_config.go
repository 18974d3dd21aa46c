package exporter

import (
	"os"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/outbox"
)

// A deliverer's defaults, the one source of the service's settings
// (TALLY_DELIVERY_WORKERS, TALLY_DELIVERY_BATCH, TALLY_DELIVERY_INFLIGHT,
// TALLY_POLL_INTERVAL, TALLY_STREAM_INFLIGHT, TALLY_STREAM_WORKERS,
// TALLY_STREAM_BATCH, TALLY_STREAM_RECORD_BATCH, TALLY_STREAM_RECORDERS).
const (
	// DefaultWorkers is how many claim loops a deliverer runs: v1's
	// (TALLY_DELIVERY_WORKERS).
	DefaultWorkers = 4
	// DefaultBatch is the most items one claim takes: v1's
	// (TALLY_DELIVERY_BATCH).
	DefaultBatch = 50
	// DefaultInFlight bounds a deliverer's sends in flight on a node: v1's
	// (TALLY_DELIVERY_INFLIGHT).
	DefaultInFlight = 64
	// DefaultPollInterval is how often an idle claim loop looks for due
	// work when no notification woke it.
	DefaultPollInterval = time.Second
	// DefaultFlushEvery is how long outcomes wait to be written together.
	DefaultFlushEvery = 20 * time.Millisecond
	// DefaultRecordBatch is the most outcomes written in one transaction.
	DefaultRecordBatch = 100
	// DefaultRecorders is how many batches of outcomes v1's deliverer
	// writes at once: one, on a connection of its own, is far from its
	// bound (its sends are).
	DefaultRecorders = 1
	// DefaultStreamInFlight bounds the v2 stream's events in flight on a
	// node: 20 requests of StreamMaxEvents.
	DefaultStreamInFlight = 20 * StreamMaxEvents
	// DefaultStreamWorkers is how many claim loops the v2 stream's
	// deliverer runs. Fewer than v1's: one claim fills five requests, and
	// the stream's benchmark gains nothing from more loops
	// (docs/performance.md).
	DefaultStreamWorkers = 3
	// DefaultStreamBatch is the most items one claim of the v2 stream's
	// deliverer takes: five requests' worth, not outbox.MaxClaim: with
	// DefaultStreamInFlight events in flight, a claim of 1,000 waits for
	// half the node's slots and the loops take turns instead of overlapping.
	DefaultStreamBatch = 500
	// DefaultStreamRecordBatch is the most outcomes of the v2 stream
	// written in one transaction: a whole claim's.
	DefaultStreamRecordBatch = 1000
	// DefaultAdjustWorkers, DefaultAdjustBatch and DefaultAdjustInFlight
	// size the deliverer of meter event adjustments: one claim loop of a
	// few items, since a handful of calls in flight keep pace with the
	// budget's Adjust class (20 a second live), and the class, not the
	// loop, is what bounds a bulk cancellation. DefaultAdjustInFlight is
	// the most in flight (AdjustInFlight).
	DefaultAdjustWorkers  = 1
	DefaultAdjustBatch    = 10
	DefaultAdjustInFlight = 10
	// DefaultStreamRecorders is how many batches of the v2 stream's
	// outcomes are written at once. With one, writing the accepts bounds
	// the stream: its connection is busy nearly all of a run.
	DefaultStreamRecorders = 2
)

// AdjustInFlight is how many adjustments the deliverer of meter event
// adjustments keeps in flight at perSecond: half a second's worth, at least
// one and at most DefaultAdjustInFlight, so that a send's queue at the
// limiter stays short beside the lease (NewDeliverer checks it).
func AdjustInFlight(perSecond float64) int {
	return max(1, min(DefaultAdjustInFlight, int(perSecond/2)))
}

// DelivererConfig are a deliverer's knobs; zero values mean the defaults.
type DelivererConfig struct {
	// Workers is how many claim loops run. Defaults to DefaultWorkers.
	Workers int
	// Batch is the most items one claim takes. Defaults to DefaultBatch.
	Batch int
	// InFlight bounds the sends in flight on this node. Defaults to
	// DefaultInFlight.
	InFlight int
	// PollInterval is how often an idle worker looks for due work when no
	// notification woke it (retries fall due this way). Defaults to
	// DefaultPollInterval.
	PollInterval time.Duration
	// FlushEvery is how long outcomes wait to be written together.
	// Defaults to DefaultFlushEvery.
	FlushEvery time.Duration
	// Policy is the claim's ordering policy. Defaults to outbox.PerKey.
	Policy outbox.Policy
	// RecordBatch is the most outcomes written in one transaction.
	// Defaults to DefaultRecordBatch.
	RecordBatch int
	// Recorders is how many batches of outcomes are written at once, each
	// on a connection of its own. Defaults to DefaultRecorders.
	Recorders int
	// Owner prefixes the lease owner of every claim. Defaults to
	// hostname:pid.
	Owner string
	// Keys, when set, hears whether the provider refuses this node's key
	// (the Resolver: /readyz reports the stall).
	Keys KeyHealth
	// Accounts, when set, are the connected accounts tenant mappings name
	// (Connect): an item staged for one is sent there with
	// Stripe-Account, and one Stripe refuses stalls alone. Nil: every item
	// must be staged for the node's own destination.
	Accounts *Connected
	// Listen is the connection the listener of notifications opens, one
	// that keeps a session (LISTEN needs one, which a transaction-mode
	// pooler does not give). Nil: one like the pool's. Unused with
	// PollOnly.
	Listen *pgx.ConnConfig
	// PollOnly, when set, runs no listener: idle workers find new work
	// every PollInterval only. For a pool behind a transaction-mode
	// pooler with no direct connection to listen on.
	PollOnly bool
	// Meters, when set, is the directory of the destination accounts'
	// meters: claims leave the items of paused event names alone (their
	// meters are all deactivated), and each accepted item records the meter
	// its event name resolved to. Nil: neither.
	Meters *MeterDirectory
}

// KeyHealth hears what deliveries say about the API key.
type KeyHealth interface {
	// KeyRefused: a 401 or 403; true when that is news.
	KeyRefused(status int) bool
	// KeyWorks: an accepted delivery; true when the key was refused until now.
	KeyWorks() bool
}

func (c DelivererConfig) withDefaults() DelivererConfig {
	if c.Workers <= 0 {
		c.Workers = DefaultWorkers
	}
	if c.Batch <= 0 {
		c.Batch = DefaultBatch
	}
	if c.InFlight <= 0 {
		c.InFlight = DefaultInFlight
	}
	if c.PollInterval <= 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.RecordBatch <= 0 {
		c.RecordBatch = DefaultRecordBatch
	}
	if c.Recorders <= 0 {
		c.Recorders = DefaultRecorders
	}
	if c.FlushEvery <= 0 {
		c.FlushEvery = DefaultFlushEvery
	}
	if c.Owner == "" {
		host, _ := os.Hostname()
		c.Owner = host + ":" + strconv.Itoa(os.Getpid())
	}
	return c
}
