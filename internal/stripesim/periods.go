package stripesim

import "time"

// Billing periods, as Stripe sets them from the billing cycle anchor: "It
// sets the day of week for week intervals, the day of month for month and
// year intervals, and the month of year for year intervals", and "A
// monthly subscription with a billing cycle anchor date of January 31
// bills the last day of the month closest to the anchor date, so February
// 28 (or February 29 in a leap year), then March 31, April 30, and so on"
// (docs.stripe.com/billing/subscriptions/billing-cycle). Dates are in UTC
// ("The timestamp is in UTC format", stripe-go
// Subscription.BillingCycleAnchor).

// billingDate is the k-th billing date from anchor (k = 0 is the anchor):
// k whole intervals later, each month- or year-based date on the anchor's
// day of month, clamped to the month's last day, at the anchor's time of
// day. Every date is computed from the anchor, never from the previous
// date, so that a clamped February 28 returns to the 31st in March.
func billingDate(anchor time.Time, interval string, count, k int64) time.Time {
	anchor = anchor.UTC()
	switch interval {
	case "day":
		return anchor.AddDate(0, 0, int(count*k))
	case "week":
		return anchor.AddDate(0, 0, int(7*count*k))
	}
	months := count * k
	if interval == "year" {
		months *= 12
	}
	total := int64(anchor.Month()-1) + months
	y, m := anchor.Year()+int(total/12), time.Month(total%12+1)
	d := min(anchor.Day(), daysIn(y, m))
	return time.Date(y, m, d, anchor.Hour(), anchor.Minute(), anchor.Second(), anchor.Nanosecond(), time.UTC)
}

// daysIn is the number of days of month m of year y.
func daysIn(y int, m time.Month) int {
	return time.Date(y, m+1, 0, 0, 0, 0, 0, time.UTC).Day()
}

// firstBillingIndex is the index k of the first billing date from anchor
// strictly after t: the end of the period running at t.
func firstBillingIndex(anchor time.Time, interval string, count int64, t time.Time) int64 {
	var k int64
	for !billingDate(anchor, interval, count, k).After(t) {
		k++
	}
	return k
}
