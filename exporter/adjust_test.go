package exporter_test

import (
	"cmp"
	"context"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/outbox"
)

// An answer to a meter event adjustment is never proof: a 2xx is accepted;
// the key's, the account's, a conflict's and a limiter's answers are what
// they are for events; every other 4xx — an identifier Stripe says it does
// not know, one already cancelled, one received too long ago, in words
// Tally cannot rely on — quarantines the cancellation for a human, never
// rejects it and never resends it as new.
func TestClassifyAdjustment(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		a      exporter.Answer
		kind   outbox.OutcomeKind
		code   string
		reason outbox.Reason
	}{
		{"200 pending or complete", exporter.Answer{Status: 200, RequestID: "req_1"}, outbox.Accepted, "", ""},
		{"already cancelled", exporter.Answer{Status: 400, Param: "cancel[identifier]",
			Message: "The meter event with identifier 'tly_x' has already been cancelled."}, outbox.Quarantined, "stripe_refused", outbox.ReasonProviderRefused},
		{"no such event as a 400", exporter.Answer{Status: 400, Code: "resource_missing"}, outbox.Quarantined, "resource_missing", outbox.ReasonProviderRefused},
		{"no such event as a 404", exporter.Answer{Status: 404, Code: "resource_missing"}, outbox.Quarantined, "resource_missing", outbox.ReasonProviderRefused},
		{"v2's invalid_cancel_configuration", exporter.Answer{Status: 400, Code: "invalid_cancel_configuration"}, outbox.Quarantined, "invalid_cancel_configuration", outbox.ReasonProviderRefused},
		{"a 404 without a code is the endpoint", exporter.Answer{Status: 404}, outbox.Retry, "stripe_not_found", ""},
		{"account_invalid", exporter.Answer{Status: 400, Code: "account_invalid"}, outbox.Retry, "stripe_account_refused", ""},
		{"401", exporter.Answer{Status: 401}, outbox.Retry, "stripe_auth", ""},
		{"409", exporter.Answer{Status: 409, Code: "lock_timeout"}, outbox.Retry, "stripe_conflict", ""},
		{"429 from a limiter", exporter.Answer{Status: 429, RateLimitedReason: "global-rate"}, outbox.RateLimited, "rate_limited", ""},
		{"500", exporter.Answer{Status: 500}, outbox.Retry, "stripe_5xx", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			o := exporter.ClassifyAdjustment(tc.a)
			require.Equal(t, tc.kind, o.Kind, "%+v", o)
			require.Equal(t, tc.code, o.Error.Code)
			require.Equal(t, tc.reason, o.Reason)
			require.NotEqual(t, outbox.Rejected, o.Kind, "a cancellation is never rejected")
		})
	}
}

// A cancellation item sent through the v1 exporter cancels the event at
// the simulator (it leaves the aggregate), in the item's connected account;
// a resend — a crash between the POST and its outcome — cancels nothing
// twice: the default simulator refuses it, and the exporter learns from
// the first attempt's key that Stripe took it (accepted); the worst-case
// simulator answers it like the first (accepted); an unknown identifier is
// quarantined.
func TestAdjustmentCancelsOnceThroughTheV1Exporter(t *testing.T) {
	t.Parallel()
	for _, again := range []bool{false, true} {
		t.Run(map[bool]string{false: "a second cancel refused", true: "a second cancel answered 200"}[again], func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			sim := stripesim.New(stripesim.Options{CancelAgainSucceeds: again})
			srv := httptest.NewServer(sim.Handler())
			t.Cleanup(func() { sim.Close(); srv.Close() })
			const conn = "acct_1Tenant"
			sim.AddAccount(conn)
			sim.CreateMeter(conn, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
			sim.CreateCustomer(conn, "cus_a")
			client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
			require.NoError(t, err)
			v1 := exporter.NewStripeV1(client, 5*time.Second).ForAccounts(func(a string) string { return a })

			ident := func(c byte) string { return "tly_" + strings.Repeat(string(c), 64) }
			event := func(id string) outbox.Lease {
				return outbox.Lease{Item: outbox.Item{Identity: outbox.Identity{SubjectKind: outbox.SubjectUsageEvent, DestinationAccount: conn},
					Attempts: 1, Payload: outbox.Payload{Customer: "cus_a", EventName: "logins", Value: 1,
						Timestamp: time.Now().Add(-time.Hour).Unix(), Identifier: id}}}
			}
			cancel := func(self byte, target string, attempt int) outbox.Lease {
				return outbox.Lease{Item: outbox.Item{Identity: outbox.Identity{SubjectKind: outbox.SubjectUsageCancellation, DestinationAccount: conn},
					Attempts: attempt, Payload: outbox.Payload{Customer: "cus_a", EventName: "logins", Identifier: ident(self), Cancels: target}}}
			}
			for _, id := range []string{ident('a'), ident('b')} {
				require.Equal(t, outbox.Accepted, v1.Send(ctx, event(id)).Kind)
			}
			_, n, _ := sim.Aggregate(conn, "logins", "cus_a")
			require.Equal(t, 2, n)

			o := v1.Send(ctx, cancel('c', ident('a'), 1))
			require.Equal(t, outbox.Accepted, o.Kind, "%+v", o)
			_, n, _ = sim.Aggregate(conn, "logins", "cus_a")
			require.Equal(t, 1, n, "the event left the aggregate")

			again2 := v1.Send(ctx, cancel('c', ident('a'), 2))
			require.Equal(t, outbox.Accepted, again2.Kind, "%+v", again2)
			_, n, _ = sim.Aggregate(conn, "logins", "cus_a")
			require.Equal(t, 1, n, "a resend cancels nothing more")

			unknown := v1.Send(ctx, cancel('d', ident('z'), 1))
			require.Equal(t, outbox.Quarantined, unknown.Kind, "%+v", unknown)

			var keys []string
			for _, r := range sim.Requests() {
				if r.Path == "/v1/billing/meter_event_adjustments" {
					require.Equal(t, conn, r.StripeAccount, "sent to the item's account")
					keys = append(keys, r.IdempotencyKey)
				}
			}
			want := []string{ident('c') + "-a1", ident('c') + "-a2", ident('d') + "-a1"}
			if !again {
				// The refused resend asked the first attempt's key.
				want = []string{ident('c') + "-a1", ident('c') + "-a2", ident('c') + "-a1", ident('d') + "-a1"}
			}
			require.Equal(t, want, keys, "a key per attempt")
		})
	}
}

// A resend of a cancellation that Stripe refuses asks the earlier
// attempts' keys, oldest first, what they got before quarantining: a kept
// success is accepted, however many refused attempts came after it or
// (within the window) 429s before it; a kept 500, or a key never carried
// out that now meets the refusal too, says nothing, and the item is
// quarantined with its own attempt's answer; a probe the limiter refuses
// retries the item, and the attempt does not count as refused — its own
// call reached Stripe.
func TestAdjustmentResendAsksEarlierKeys(t *testing.T) {
	t.Parallel()
	const acct = stripesim.DefaultAccount
	ident := func(c byte) string { return "tly_" + strings.Repeat(string(c), 64) }
	target := ident('e')
	cancel := func(attempt, refused int) outbox.Lease {
		return outbox.Lease{Item: outbox.Item{Identity: outbox.Identity{SubjectKind: outbox.SubjectUsageCancellation},
			Attempts: attempt, RefusedAttempts: refused,
			Payload: outbox.Payload{Customer: "cus_a", EventName: "logins", Identifier: ident('c'), Cancels: target}}}
	}
	send := func(t *testing.T, sim *stripesim.Server, v1 *exporter.StripeV1, f stripesim.Faults, want outbox.OutcomeKind, attempts ...int) {
		sim.Configure(acct, stripesim.Limits{Faults: f})
		for _, a := range attempts {
			require.Equal(t, want, v1.Send(context.Background(), cancel(a, 0)).Kind, "attempt %d", a)
		}
	}
	for _, tc := range []struct {
		name string
		// first sends what happens before the resend under test (attempt
		// 3 unless attempt says otherwise, after refused attempts Stripe
		// refused), with the simulator's limits for it.
		first            func(t *testing.T, sim *stripesim.Server, v1 *exporter.StripeV1)
		attempt, refused int
		resend           stripesim.Limits
		kind             outbox.OutcomeKind
		probes           []string // the keys the resend used, its own first
	}{
		{"attempt 2 carried out, its reply lost", func(t *testing.T, sim *stripesim.Server, v1 *exporter.StripeV1) {
			send(t, sim, v1, stripesim.Faults{LoseReply: 1}, outbox.Retry, 2)
		}, 0, 0, stripesim.Limits{}, outbox.Accepted, []string{"-a3", "-a1", "-a2"}},
		{"attempt 1 carried out, a kept 500", func(t *testing.T, sim *stripesim.Server, v1 *exporter.StripeV1) {
			send(t, sim, v1, stripesim.Faults{FailAfterRecord: 1}, outbox.Retry, 1)
		}, 0, 0, stripesim.Limits{}, outbox.Quarantined, []string{"-a3", "-a1", "-a2"}},
		{"cancelled elsewhere, no attempt carried out", func(t *testing.T, sim *stripesim.Server, v1 *exporter.StripeV1) {
			require.Equal(t, outbox.Accepted, v1.Send(context.Background(), outbox.Lease{Item: outbox.Item{
				Identity: outbox.Identity{SubjectKind: outbox.SubjectUsageCancellation}, Attempts: 1,
				Payload: outbox.Payload{EventName: "logins", Identifier: ident('x'), Cancels: target}}}).Kind)
		}, 0, 0, stripesim.Limits{}, outbox.Quarantined, []string{"-a3", "-a1", "-a2"}},
		{"the probe rate-limited", func(t *testing.T, sim *stripesim.Server, v1 *exporter.StripeV1) {
			send(t, sim, v1, stripesim.Faults{LoseReply: 1}, outbox.Retry, 2)
		}, 0, 0, stripesim.Limits{BasicRatePerSecond: 0.001, BasicBurst: 1}, outbox.Retry, []string{"-a3", "-a1"}},
		// TestCancelAdjustmentsSurviveKills's story: the attempt that
		// cancelled lost its reply, and three more met the refusal while
		// their probes of it failed. Newest first asked a4, a3 and a2 and
		// quarantined what Stripe had carried out.
		{"attempt 1 carried out, three refused after it", func(t *testing.T, sim *stripesim.Server, v1 *exporter.StripeV1) {
			send(t, sim, v1, stripesim.Faults{LoseReply: 1}, outbox.Retry, 1, 2, 3, 4)
		}, 5, 0, stripesim.Limits{}, outbox.Accepted, []string{"-a5", "-a1"}},
		// Stripe's limiter refused the first three attempts unexecuted;
		// the fourth cancelled and lost its reply. The window widens by
		// the three refusals.
		{"attempt 4 carried out after three 429s", func(t *testing.T, sim *stripesim.Server, v1 *exporter.StripeV1) {
			send(t, sim, v1, stripesim.Faults{RateLimitFault: 1}, outbox.RateLimited, 1, 2, 3)
			send(t, sim, v1, stripesim.Faults{LoseReply: 1}, outbox.Retry, 4)
		}, 5, 3, stripesim.Limits{}, outbox.Accepted, []string{"-a5", "-a1", "-a2", "-a3", "-a4"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			sim := stripesim.New(stripesim.Options{})
			srv := httptest.NewServer(sim.Handler())
			t.Cleanup(func() { sim.Close(); srv.Close() })
			sim.CreateMeter(acct, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
			sim.CreateCustomer(acct, "cus_a")
			client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
			require.NoError(t, err)
			v1 := exporter.NewStripeV1(client, 5*time.Second)
			require.Equal(t, outbox.Accepted, v1.Send(context.Background(), outbox.Lease{Item: outbox.Item{
				Identity: outbox.Identity{SubjectKind: outbox.SubjectUsageEvent}, Attempts: 1,
				Payload: outbox.Payload{Customer: "cus_a", EventName: "logins", Value: 1,
					Timestamp: time.Now().Add(-time.Hour).Unix(), Identifier: target}}}).Kind)
			tc.first(t, sim, v1)
			before := len(sim.Requests())
			sim.Configure(acct, tc.resend)

			o := v1.Send(context.Background(), cancel(cmp.Or(tc.attempt, 3), tc.refused))
			require.Equal(t, tc.kind, o.Kind, "%+v", o)
			require.False(t, o.Refused, "the attempt's own call reached Stripe")
			if o.Kind == outbox.Quarantined {
				require.Equal(t, outbox.ReasonProviderRefused, o.Reason)
				require.Equal(t, 400, o.Error.Status, "the attempt's own answer")
			}
			var keys []string
			for _, r := range sim.Requests()[before:] {
				keys = append(keys, strings.TrimPrefix(r.IdempotencyKey, ident('c')))
			}
			require.Equal(t, tc.probes, keys)
			_, n, _ := sim.Aggregate(acct, "logins", "cus_a")
			require.Zero(t, n, "cancelled once, whatever was asked")
		})
	}
}
