package quarantine

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/tallymeter/tally/internal/testkit/benchstat"
	"github.com/tallymeter/tally/internal/testkit/stagetest"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/meter"
	"github.com/tallymeter/tally/outbox"
)

// BenchmarkReportMoney measures what pricing adds to a month's report:
// 200 tenants of their own customers × 10 features on 10 meters, each
// customer subscribed to the 10 prices (2,000 lines, 2,000 items), the
// report read from the counters alone (the baseline) and then priced,
// alternating, in one run.
//
//	go test ./quarantine -run '^$' -bench ReportMoney -benchtime 1x
func BenchmarkReportMoney(b *testing.B) {
	const tenants, features = 200, 10
	e := stagetest.New(b, outbox.Config{})
	ctx := context.Background()
	at := stagetest.Ago(10 * time.Minute)
	month := at.Format("2006-01")
	var evs []meter.Event
	for f := range features {
		name := fmt.Sprintf("f%d", f)
		e.Feature(b, name, mappings.Sum, time.Hour)
		_, err := e.Pool.Exec(ctx, `INSERT INTO stripe_meters (account, mode, id, event_name, status, formula)
			VALUES ('', 'test', $1, $2, 'active', 'sum')`, "mtr_"+name, name)
		check(b, err)
		_, err = e.Pool.Exec(ctx, `INSERT INTO stripe_prices (account, price, body) VALUES ('', $1, jsonb_build_object('id', $1::text,
			'object', 'price', 'currency', 'usd', 'type', 'recurring', 'billing_scheme', 'tiered', 'tiers_mode', 'graduated',
			'tiers', jsonb_build_array(jsonb_build_object('up_to', 100, 'unit_amount_decimal', '5'),
				jsonb_build_object('up_to', null, 'unit_amount_decimal', '2.5')),
			'recurring', jsonb_build_object('usage_type', 'metered', 'interval', 'month', 'interval_count', 1)))`, "price_"+name)
		check(b, err)
	}
	for t := range tenants {
		tenant := fmt.Sprintf("t%d", t)
		e.Tenant(b, tenant, nil)
		for f := range features {
			_, err := e.Pool.Exec(ctx, `INSERT INTO stripe_subscription_items (account, item, customer, subscription, status, price, meter,
				currency, billing_interval, interval_count, billing_cycle_anchor, current_period_start, current_period_end, start_date)
				VALUES ('', $1, $2, $3, 'active', $4, $5, 'usd', 'month', 1, '2000-01-01', '2000-01-01', '2000-02-01', '2000-01-01')`,
				fmt.Sprintf("si_%d_%d", t, f), "cus_"+tenant, "sub_"+tenant, fmt.Sprintf("price_f%d", f), fmt.Sprintf("mtr_f%d", f))
			check(b, err)
			evs = append(evs, stagetest.Ev(fmt.Sprintf("e%d-%d", t, f), tenant, fmt.Sprintf("f%d", f), int64(50+t), at))
		}
	}
	e.MustIngest(b, evs...)
	_, err := e.Pool.Exec(ctx, "ANALYZE")
	check(b, err)
	b.ResetTimer()

	var plain, priced []time.Duration
	for range 15 {
		start := time.Now()
		c, err := CompletenessOf(ctx, e.Pool, month, "")
		check(b, err)
		plain = append(plain, time.Since(start))
		start = time.Now()
		c, err = CompletenessOf(ctx, e.Pool, month, "")
		check(b, err)
		check(b, c.addMoney(ctx, e.Pool))
		priced = append(priced, time.Since(start))
		if len(c.Lines) != tenants*features || c.UnpricedLines != 0 {
			b.Fatalf("%d lines, %d unpriced", len(c.Lines), c.UnpricedLines)
		}
	}
	p, q := benchstat.Median(plain), benchstat.Median(priced)
	fmt.Printf("\n%d lines, %d subscription items: report %s, priced %s (median of 15): pricing adds %s, %.1f µs a line\n",
		tenants*features, tenants*features, p.Round(10*time.Microsecond), q.Round(10*time.Microsecond),
		(q - p).Round(10*time.Microsecond), float64((q-p).Microseconds())/float64(tenants*features))
}

func check(b *testing.B, err error) {
	b.Helper()
	if err != nil {
		b.Fatal(err)
	}
}
