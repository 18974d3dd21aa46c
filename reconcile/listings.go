package reconcile

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// Listing is the state of one account's listing of Stripe's events.
type Listing struct {
	Account string
	Mode    outbox.Mode
	// Newest is the created time of the newest report the listing has
	// seen; zero when it has seen none.
	Newest time.Time
	// SinceListed is how long ago a listing of the account last succeeded,
	// by the database's clock; Listed is false when none has.
	SinceListed time.Duration
	Listed      bool
	// Failure is how the last listing failed, when it failed after the
	// last success; nil otherwise.
	Failure *outbox.ErrorInfo
}

// Listings reads every account's listing, by account and mode: one row per
// account Tally has listed (a few per connected account).
func Listings(ctx context.Context, q pgdb.Querier) ([]Listing, error) {
	rows, err := q.Query(ctx, `SELECT account, mode, last_created, extract(epoch FROM clock_timestamp() - listed_at)::float8,
		    fail_code, fail_status
		FROM stripe_event_listings ORDER BY account, mode`)
	if err != nil {
		return nil, fmt.Errorf("reconcile: reading the events listings: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Listing, error) {
		var (
			l       Listing
			newest  *time.Time
			since   *float64
			code    *string
			status  *int
			account string
			mode    string
		)
		if err := row.Scan(&account, &mode, &newest, &since, &code, &status); err != nil {
			return l, err
		}
		l.Account, l.Mode = account, outbox.Mode(mode)
		if newest != nil {
			l.Newest = *newest
		}
		if since != nil {
			l.SinceListed, l.Listed = seconds(*since), true
		}
		if code != nil {
			l.Failure = &outbox.ErrorInfo{Code: *code}
			if status != nil {
				l.Failure.Status = *status
			}
		}
		return l, nil
	})
	if err != nil {
		return nil, fmt.Errorf("reconcile: reading the events listings: %w", err)
	}
	return out, nil
}

// SinceLastListing is how long ago, by the database's clock, a listing of
// Stripe's events last succeeded for any account, on any node; false when
// none has.
func SinceLastListing(ctx context.Context, q pgdb.Querier) (time.Duration, bool, error) {
	return sinceOf(ctx, q, `SELECT extract(epoch FROM clock_timestamp() - max(listed_at))::float8 FROM stripe_event_listings`)
}

// SinceLastDelivery is how long ago, by the database's clock, the event
// destination last delivered an event Tally records (to any node); false
// when it never has. Reports are rare when all is well, so a long time
// alone says little; EventsHealth.Missed says more.
func SinceLastDelivery(ctx context.Context, q pgdb.Querier) (time.Duration, bool, error) {
	return sinceOf(ctx, q, `SELECT extract(epoch FROM clock_timestamp() - max(received_at))::float8 FROM stripe_events
		WHERE arrival = 'destination'`)
}

func sinceOf(ctx context.Context, q pgdb.Querier, sql string) (time.Duration, bool, error) {
	var s *float64
	if err := q.QueryRow(ctx, sql).Scan(&s); err != nil {
		return 0, false, fmt.Errorf("reconcile: reading Stripe's events: %w", err)
	}
	if s == nil {
		return 0, false, nil
	}
	return seconds(*s), true, nil
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// EventsHealth is what the events of the last 30 days (Stripe's retention)
// say of how they reach Tally.
type EventsHealth struct {
	// Missed counts the events the listing recorded before the event
	// destination delivered them: the destination was down, or does not
	// send that account's events.
	Missed int64
	// Unreadable counts the events Stripe refused to let Tally read that
	// it still keeps (the listing reads them again).
	Unreadable int64
	// Foreign counts the events about accounts Tally does not export to.
	Foreign int64
}

// ReadEventsHealth counts the events of the last 30 days by how they
// arrived and what came of them: a read of those days' events, for `tally
// doctor`.
func ReadEventsHealth(ctx context.Context, q pgdb.Querier) (EventsHealth, error) {
	var h EventsHealth
	err := q.QueryRow(ctx, `SELECT
		    count(*) FILTER (WHERE arrival = 'listing'),
		    count(*) FILTER (WHERE status = 'unreadable' AND created > clock_timestamp() - make_interval(secs => $1)),
		    count(*) FILTER (WHERE status = 'foreign')
		FROM stripe_events WHERE received_at > clock_timestamp() - make_interval(secs => $1)`,
		stripeapi.EventRetention.Seconds()).Scan(&h.Missed, &h.Unreadable, &h.Foreign)
	if err != nil {
		return h, fmt.Errorf("reconcile: reading Stripe's events: %w", err)
	}
	return h, nil
}
