package quarantine_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/audit"
	"github.com/tallymeter/tally/mappings"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
)

// sendAndAccept claims the one due item and records Stripe's 200 for it.
func (b *bundle) sendAndAccept(t *testing.T) outbox.Lease {
	t.Helper()
	leases, err := b.Outbox.Claim(b.Ctx, b.Pool, outbox.ClaimOptions{Owner: "t", Limit: 1})
	require.NoError(t, err)
	require.Len(t, leases, 1)
	require.NoError(t, b.Outbox.Accept(b.Ctx, b.Pool, leases[0], "req_1"))
	return leases[0]
}

// Stripe answered 200, then its error report said the customer did not
// exist (T10): nothing was recorded under the identifier. The operator
// creates the customer at Stripe — no mapping changes — and requeues. A
// resend under the same identifier would be answered with the saved 200
// within a day, or the duplicate-identifier 400 after it, and both read as
// accepted while nothing is counted: the requeue re-addresses the item
// instead, in one transaction, audited, and the usage is counted once.
func TestRequeueAfterAnErrorReportReaddresses(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := b.Feature(t, "api", mappings.Sum, time.Hour)
	tn := b.Tenant(t, "acme", nil)
	b.MustIngest(t, ev("a", "acme", "api", 5, ago(3*time.Hour)), ev("b", "acme", "api", 6, ago(3*time.Hour)))
	b.Pass(t)
	l := b.sendAndAccept(t)
	failed, _, err := b.Outbox.FailAccepted(b.Ctx, b.Pool, []outbox.ProviderFailure{{ID: l.ID, To: outbox.StateQuarantined,
		Reason: outbox.ReasonCustomerNotFound, Error: outbox.ErrorInfo{Code: "meter_event_customer_not_found"}}})
	require.NoError(t, err)
	require.Equal(t, []int64{l.ID}, failed)

	version := max(f.Version, tn.Version)
	res, err := b.requeuer.Requeue(b.Ctx, b.Pool, l.ID, version, "op")
	require.NoError(t, err)
	require.Equal(t, quarantine.ActionReaddressed, res.Action)
	require.Equal(t, version, res.MappingVersion, "no mapping changed")
	require.NotNil(t, res.Successor)

	old, err := b.Outbox.Get(b.Ctx, b.Pool, l.ID)
	require.NoError(t, err)
	require.Equal(t, outbox.StateSuperseded, old.State)
	require.Equal(t, *res.Successor, *old.SupersededBy)
	succ, err := b.Outbox.Get(b.Ctx, b.Pool, *res.Successor)
	require.NoError(t, err)
	require.Equal(t, outbox.StatePending, succ.State)
	require.NotEqual(t, l.Identifier, succ.Identifier, "a new identifier")
	require.Equal(t, l.SubjectRef+"%r1", succ.SubjectRef)
	require.Equal(t, outbox.BaseRef(l.SubjectRef), outbox.BaseRef(succ.SubjectRef), "the same usage")
	require.Equal(t, int64(11), succ.Payload.Value)
	require.Equal(t, version, succ.MappingVersion)

	trail, err := audit.List(b.Ctx, b.Pool, audit.Item(l.ID), 10)
	require.NoError(t, err)
	require.Len(t, trail, 1)
	require.Equal(t, audit.ActionReaddress, trail[0].Action)
	require.Equal(t, "op", trail[0].Actor)
	require.EqualValues(t, *res.Successor, trail[0].Details["successor"])
	require.NotEmpty(t, trail[0].Details["readdressed_because"])

	c, err := quarantine.CompletenessOf(b.Ctx, b.Pool, time.Now().UTC().Add(-3*time.Hour).Format("2006-01"), "acme")
	require.NoError(t, err)
	require.True(t, c.Holds)
	require.Equal(t, quarantine.Bucket{Events: 2, Value: quarantine.ValueOf(11)}, c.Lines[0].Pending, "counted once, on the successor")

	// The successor is sent, and Stripe's report fails it again: the next
	// requeue gives the next generation, never a ref seen before.
	b.sendAndAccept(t)
	_, _, err = b.Outbox.FailAccepted(b.Ctx, b.Pool, []outbox.ProviderFailure{{ID: succ.ID, To: outbox.StateQuarantined,
		Reason: outbox.ReasonCustomerNotFound, Error: outbox.ErrorInfo{Code: "meter_event_customer_not_found"}}})
	require.NoError(t, err)
	res, err = b.requeuer.Requeue(b.Ctx, b.Pool, succ.ID, version, "op")
	require.NoError(t, err)
	require.Equal(t, quarantine.ActionReaddressed, res.Action)
	third, err := b.Outbox.Get(b.Ctx, b.Pool, *res.Successor)
	require.NoError(t, err)
	require.Equal(t, l.SubjectRef+"%r2", third.SubjectRef)

	// Late usage of the window still becomes supplement #1: re-addressed
	// refs are not counted as supplements.
	hour := time.Unix(l.Payload.Timestamp, 0).UTC()
	b.MustIngest(t, ev("late", "acme", "api", 1, &hour))
	b.Pass(t)
	require.Equal(t, l.SubjectRef+"#1", b.itemOf(t, "acme", "late").SubjectRef)
}

// A synchronous refusal proves as much as a report: every attempt was
// refused, so a requeue re-addresses even when no mapping changed.
func TestRequeueAfterARefusalReaddresses(t *testing.T) {
	t.Parallel()
	b := setup(t)
	f := b.Feature(t, "api", mappings.Sum, time.Hour)
	tn := b.Tenant(t, "acme", nil)
	b.MustIngest(t, ev("a", "acme", "api", 5, ago(3*time.Hour)))
	b.Pass(t)
	leases, err := b.Outbox.Claim(b.Ctx, b.Pool, outbox.ClaimOptions{Owner: "t", Limit: 1})
	require.NoError(t, err)
	require.NoError(t, b.Outbox.Quarantine(b.Ctx, b.Pool, leases[0], outbox.ReasonCustomerNotFound,
		outbox.ErrorInfo{Code: "customer_not_found", Status: 400}))
	res, err := b.requeuer.Requeue(b.Ctx, b.Pool, leases[0].ID, max(f.Version, tn.Version), "op")
	require.NoError(t, err)
	require.Equal(t, quarantine.ActionReaddressed, res.Action)
	succ, err := b.Outbox.Get(b.Ctx, b.Pool, *res.Successor)
	require.NoError(t, err)
	require.NotEqual(t, leases[0].Identifier, succ.Identifier)
}
