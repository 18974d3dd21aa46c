package history

import (
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/outbox"
)

// gen builds the fixture's rows on the fly, for COPY: item i is tenant and
// feature i mod keys in hour i / keys from from; it carries the ledger rows
// span(i), spread evenly over its hour.
type gen struct {
	size     Size
	from     time.Time
	versions []int   // by key
	buckets  []int16 // by tenant, as Tenants
}

var (
	bodyColumns = []string{"id", "tenant_key", "subject_kind", "subject_ref", "exporter", "destination_account", "mode",
		"mapping_version", "payload", "created_at", "bucket"}
	stateColumns = []string{"id", "exporter", "mode", "ordering_key", "state", "attempts", "lease_token",
		"next_attempt_at", "first_attempt_at", "lease_owner", "leased_at", "accepted_at", "confirmed_at", "created_at",
		"updated_at", "bucket"}
	attemptColumns = []string{"item_id", "lease_token", "lease_owner", "leased_at", "outcome", "state_after", "refused",
		"recorded_at", "bucket"}
	eventColumns = []string{"tenant", "event_id", "feature", "value", "occurred_at", "timestamp_given", "received_at",
		"item_id", "staged_at", "bucket"}
)

// The moments of an item's life, from the start of its hour.
const (
	stagedAfter    = time.Hour + 3*time.Minute
	acceptedAfter  = stagedAfter + 2*time.Second
	confirmedAfter = 7 * time.Hour
	leaseOwner     = "node-1:1234:worker-2"
)

func (g gen) keys() int64 { return int64(len(Tenants) * len(Features)) }

// bucket is the bucket of item i's tenant.
func (g gen) bucket(i int64) int16 { return g.buckets[i%g.keys()/int64(len(Features))] }

// span is the ledger rows [lo, hi) of item i: Rows spread over Items as
// evenly as whole rows allow.
func (g gen) span(i int64) (lo, hi int64) {
	return i * g.size.Rows / g.size.Items, (i + 1) * g.size.Rows / g.size.Items
}

// key is item i's tenant and feature, and its hour.
func (g gen) key(i int64) (tenant, feature string, key int64, hour time.Time) {
	k := i % g.keys()
	return Tenants[k/int64(len(Features))], Features[k%int64(len(Features))], k,
		g.from.Add(time.Duration(i/g.keys()) * time.Hour)
}

// value is ledger row e's value; an item's is the sum of its rows'.
func value(e int64) int64 { return 1 + e%7 }

// bodies are the items' outbox_item_bodies rows: identity and payload.
func (g gen) bodies() pgx.CopyFromSource {
	var i int64
	return pgx.CopyFromFunc(func() ([]any, error) {
		if i >= g.size.Items {
			return nil, nil
		}
		id, p, hour := g.item(i)
		b := g.bucket(i)
		i++
		return []any{i, id.TenantKey, id.SubjectKind, id.SubjectRef, id.Exporter, id.DestinationAccount, string(id.Mode),
			id.MappingVersion, payloadJSON(p), hour.Add(stagedAfter), b}, nil
	})
}

// states are the items' outbox_item_states rows: each confirmed after one
// accepted attempt.
func (g gen) states() pgx.CopyFromSource {
	var i int64
	return pgx.CopyFromFunc(func() ([]any, error) {
		if i >= g.size.Items {
			return nil, nil
		}
		tenant, feature, _, hour := g.key(i) // the ordering key needs no identifier: no SHA-256 twice an item
		staged, accepted := hour.Add(stagedAfter), hour.Add(acceptedAfter)
		b := g.bucket(i)
		i++
		return []any{i, Exporter, string(Mode), Account + "|" + Customer(tenant) + "|" + feature,
			string(outbox.StateConfirmed), 1, int64(1), staged, staged.Add(time.Second), leaseOwner,
			staged.Add(time.Second), accepted, hour.Add(confirmedAfter), staged, hour.Add(confirmedAfter), b}, nil
	})
}

// item is item i's identity and payload, and its hour.
func (g gen) item(i int64) (outbox.Identity, outbox.Payload, time.Time) {
	tenant, feature, k, hour := g.key(i)
	period := time.Date(hour.Year(), hour.Month(), 1, 0, 0, 0, 0, time.UTC)
	id := outbox.Identity{TenantKey: tenant, SubjectKind: outbox.SubjectUsageWindow,
		SubjectRef: "usage:" + feature + ":" + period.Format(time.RFC3339) + ":" + hour.Format(time.RFC3339) + ":" +
			hour.Add(time.Hour).Format(time.RFC3339),
		Exporter: Exporter, DestinationAccount: Account, Mode: Mode, MappingVersion: g.versions[k]}
	var v int64
	lo, hi := g.span(i)
	for e := lo; e < hi; e++ {
		v += value(e)
	}
	p := outbox.Payload{Customer: Customer(tenant), EventName: feature, Value: v,
		Timestamp: hour.Add(45 * time.Minute).Unix(), Identifier: id.Identifier(), Feature: feature,
		Period: period.Format(time.RFC3339)}
	return id, p, hour
}

func (g gen) attempts() pgx.CopyFromSource {
	var i int64
	return pgx.CopyFromFunc(func() ([]any, error) {
		if i >= g.size.Items {
			return nil, nil
		}
		_, _, _, hour := g.key(i)
		b := g.bucket(i)
		i++
		return []any{i, int64(1), leaseOwner, hour.Add(stagedAfter + time.Second), "accepted", "accepted", false,
			hour.Add(acceptedAfter), b}, nil
	})
}

func (g gen) events() pgx.CopyFromSource {
	var e, item int64
	lo, hi := g.span(0)
	return pgx.CopyFromFunc(func() ([]any, error) {
		for e >= hi && item < g.size.Items {
			item++
			lo, hi = g.span(item)
		}
		if e >= g.size.Rows {
			return nil, nil
		}
		tenant, feature, _, hour := g.key(item)
		at := hour.Add(time.Duration(e-lo)*(time.Hour/time.Duration(hi-lo)) + 7*time.Second)
		row := []any{tenant, "evt_" + strconv.FormatInt(e, 36), feature, value(e), at, true, at.Add(2 * time.Second),
			item + 1, hour.Add(stagedAfter), g.bucket(item)}
		e++
		return row, nil
	})
}

// snapshots are the gauge's five-minute snapshots over the history, every
// state, the confirmed ones counting up.
func (g gen) snapshots() pgx.CopyFromSource {
	const every = 5 * time.Minute
	steps := int64(time.Duration((g.size.Items+g.keys()-1)/g.keys()) * time.Hour / every)
	var s, st int64
	return pgx.CopyFromFunc(func() ([]any, error) {
		if st == int64(len(outbox.States)) {
			s, st = s+1, 0
		}
		if s >= steps {
			return nil, nil
		}
		state := outbox.States[st]
		n := int64(0)
		switch state {
		case outbox.StateConfirmed:
			n = min(g.size.Items, s*g.keys()/12)
		case outbox.StatePending, outbox.StateAccepted:
			n = g.keys() / 12
		}
		st++
		return []any{g.from.Add(time.Duration(s) * every), string(state), n}, nil
	})
}
