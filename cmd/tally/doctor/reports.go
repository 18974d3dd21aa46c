package doctor

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/reconcile"
)

// staleListings is how many listing intervals without a success make an
// account's listing a problem: Stripe keeps events 30 days, so reports
// are not lost yet, but none of them reaches its items meanwhile.
const staleListings = 3

// reports checks how Stripe's error reports reach Tally (package
// reconcile): when each account's listing of GET /v2/core/events last
// succeeded, and what the last 30 days' events say of the event
// destination — when it last delivered, how many reports only the listing
// found, how many Stripe refused to let Tally read. Nil without a key (the
// configuration check said so).
func reports(ctx context.Context, d Deps) *Result {
	c := d.Config
	if c.StripeAPIKey == "" {
		return nil
	}
	if config.RestrictedKey(c.StripeAPIKey) {
		return &Result{Check: "error reports", Status: Warning,
			Detail: "a restricted key (rk_…): Stripe's error reports are not listed (GET /v2/core/events takes only secret keys)",
			Fix:    "use a secret key (sk_…), so that the reports the event destination misses are listed hourly"}
	}
	listings, err := reconcile.Listings(ctx, d.Pool)
	if err != nil {
		return &Result{Check: "error reports", Status: Problem, Detail: "the listings could not be read: " + describe(err)}
	}
	health, err := reconcile.ReadEventsHealth(ctx, d.Pool)
	if err != nil {
		return &Result{Check: "error reports", Status: Problem, Detail: "the events could not be read: " + describe(err)}
	}
	sinceDelivery, delivered, err := reconcile.SinceLastDelivery(ctx, d.Pool)
	if err != nil {
		return &Result{Check: "error reports", Status: Problem, Detail: "the events could not be read: " + describe(err)}
	}
	interval := c.ReportsInterval
	if interval <= 0 {
		interval = reconcile.DefaultBackfillInterval
	}
	r := Result{Check: "error reports", Status: OK}
	var notes, fixes []string
	worse := func(s Status, fix string) {
		if s == Problem || r.Status == OK {
			r.Status = s
		}
		if fix != "" {
			fixes = append(fixes, fix)
		}
	}

	if len(listings) == 0 {
		notes = append(notes, "Stripe's events were never listed")
		worse(Warning, "tally serve lists them when it starts and every TALLY_REPORTS_INTERVAL ("+short(interval)+"): is a node running?")
	}
	var stale, failing []string
	var newest time.Duration = -1
	for _, l := range listings {
		if l.Listed && (newest < 0 || l.SinceListed < newest) {
			newest = l.SinceListed
		}
		if !l.Listed || l.SinceListed > staleListings*interval {
			stale = append(stale, l.Account)
		}
		if l.Failure != nil {
			failing = append(failing, fmt.Sprintf("%s (%s, status %d)", l.Account, l.Failure.Code, l.Failure.Status))
		}
	}
	if newest >= 0 {
		notes = append(notes, fmt.Sprintf("listed %s ago (GET /v2/core/events, every %s)", short(newest.Round(time.Second)), short(interval)))
	}
	if len(failing) > 0 {
		notes = append(notes, "the last listing failed for "+list(failing))
	}
	if len(stale) > 0 {
		notes = append(notes, fmt.Sprintf("not listed successfully for %s or more: %s", short(staleListings*interval), list(stale)))
		worse(Problem, "see the failures above: a connected account whose access was revoked (account_invalid) cannot be listed, nor a key Stripe refuses; reports about those accounts reach no item until it can be")
	}

	switch {
	case delivered:
		notes = append(notes, fmt.Sprintf("the event destination last delivered %s ago", short(sinceDelivery.Round(time.Second))))
	case c.StripeWebhookSecret != "":
		notes = append(notes, "the event destination has never delivered an event")
	}
	if health.Missed > 0 {
		notes = append(notes, fmt.Sprintf("%d reports of the last 30 days reached Tally only by the listing", health.Missed))
		worse(Warning, "check the event destination: thin events of v1.billing.meter.error_report_triggered and v1.billing.meter.no_meter_found, "+
			"from this account and (for tenants in connected accounts) from connected accounts, posted to /v1/stripe/events, signed with STRIPE_WEBHOOK_SECRET; "+
			"the listing catches up within TALLY_REPORTS_INTERVAL")
	}
	if health.Unreadable > 0 {
		notes = append(notes, fmt.Sprintf("%d events Stripe refused to let Tally read (read again at each listing)", health.Unreadable))
		worse(Warning, "the key must be able to read the events of every account Tally exports to; a connected account whose access was revoked cannot be read")
	}
	if health.Foreign > 0 {
		notes = append(notes, fmt.Sprintf("%d events about accounts Tally does not export to (recorded, not read)", health.Foreign))
	}
	r.Detail = strings.Join(notes, "; ")
	r.Fix = strings.Join(fixes, "; ")
	return &r
}

// short is d without a trailing "0s" or "0m".
func short(d time.Duration) string {
	s := d.String()
	s = strings.TrimSuffix(s, "0s")
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	if s == "" {
		return "0s"
	}
	return s
}
