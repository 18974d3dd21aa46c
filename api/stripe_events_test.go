package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/stripe/stripe-go/v82/webhook"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/internal/pgdb"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/quarantine"
	"github.com/tallymeter/tally/reconcile"
)

const webhookSecret = "whsec_test_0123456789abcdef"

// webhookConnected is the connected account a tenant mapping of the
// webhook harness names (its Connected source is fixed: the harness has no
// key to check mappings with); webhookForeign one none names.
const (
	webhookConnected = "acct_1Conn"
	webhookForeign   = "acct_1Foreign"
)

// webhookHarness is a simulator for acct_1 (meter logins, customer cus_1),
// the node's destination, and two connected accounts, webhookConnected and
// webhookForeign, each with that meter and validating asynchronously; its
// URL, a client of it, and an API harness whose webhook records events
// about acct_1 and webhookConnected, read from the simulator.
func webhookHarness(t *testing.T) (*stripesim.Server, string, *stripeapi.Client, *harness) {
	t.Helper()
	sim := stripesim.New(stripesim.Options{Keys: map[string]string{stripesim.DefaultKey: "acct_1"}})
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(func() { sim.Close(); srv.Close() })
	for _, a := range []string{"acct_1", webhookConnected, webhookForeign} {
		sim.AddAccount(a)
		sim.CreateMeter(a, stripesim.MeterSpec{DisplayName: "logins", EventName: "logins", Formula: "count"})
		sim.CreateCustomer(a, "cus_1")
		if a != "acct_1" {
			sim.Configure(a, stripesim.Limits{AsyncValidation: true})
		}
	}
	client, err := stripeapi.New(stripeapi.Config{Key: stripesim.DefaultKey, APIBase: srv.URL})
	require.NoError(t, err)
	h := newHarnessWith(t, true, func(d *api.Deps) {
		events, err := reconcile.NewEvents(reconcile.EventsConfig{Outbox: d.Outbox,
			Destination: func() (exporter.Destination, error) {
				return exporter.Destination{Exporter: exporter.StripeMeterEvents, Account: "acct_1", Mode: outbox.ModeTest}, nil
			},
			Connected: func(context.Context, pgdb.Querier) ([]string, error) { return []string{webhookConnected}, nil },
			Logger:    slog.New(slog.DiscardHandler)})
		require.NoError(t, err)
		d.Webhook = &api.WebhookDeps{Secret: webhookSecret, Events: events, Fetch: client.Event}
	})
	return sim, srv.URL, client, h
}

// webhookScenario is what the steps of TestStripeEventsWebhook share besides
// the database.
type webhookScenario struct {
	sim     *stripesim.Server
	client  *stripeapi.Client
	op      string
	leases  []outbox.Lease          // the one item, sent and then dropped by Stripe
	reports []stripesim.ErrorReport // Stripe's report of the drop
	// body and sig are the report as a good delivery signs it.
	body []byte
	sig  string
}

// post delivers body to the event destination, signed with sig unless it is
// empty.
func (s *webhookScenario) post(t *testing.T, h *harness, body []byte, sig string) response {
	req, err := http.NewRequestWithContext(h.ctx, http.MethodPost, h.url+"/v1/stripe/events", bytes.NewReader(body))
	require.NoError(t, err)
	if sig != "" {
		req.Header.Set("Stripe-Signature", sig)
	}
	return h.send(req)
}

// recorded counts the events recorded.
func (s *webhookScenario) recorded(h *harness) int64 {
	return h.count(`SELECT count(*) FROM stripe_events`)
}

// Stripe's meter error reports arrive as signed thin events: a bad or stale
// signature answers 400 and records nothing; a good one is fetched and
// recorded once, however often it is delivered, as evidence on the item,
// and the accepted item it names leaves accepted (T10) once.
func TestStripeEventsWebhook(t *testing.T) {
	t.Parallel()
	sim, _, client, h := webhookHarness(t)
	s := &webhookScenario{sim: sim, client: client}
	// In order, on one database: each step reads the item and the events
	// the steps before it recorded.
	runSteps(t, h,
		step{"sent, then dropped by Stripe", s.sendAndDrop},
		step{"bad deliveries", s.refusesBadDeliveries},
		step{"recorded once", s.recordsOnce},
		step{"evidence on the item", s.showsEvidence},
		step{"another event type", s.ignoresOtherTypes},
	)
}

// sendAndDrop maps a feature and a tenant, ingests one event, and sends its
// item to the simulator, which then drops it.
func (s *webhookScenario) sendAndDrop(t *testing.T, h *harness) {
	s.op = h.as(h.token("op", auth.RoleOperator))
	ingest := h.as(h.token("svc", auth.RoleIngest))
	require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/features/logins", s.op,
		map[string]any{"event_name": "logins", "aggregation": "count"}).status)
	require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/tenants/t1", s.op,
		map[string]any{"stripe_customer_id": "cus_1"}).status)
	require.Equal(t, http.StatusAccepted, h.request(http.MethodPost, "/v1/usage", ingest,
		batch(event{"id": "e1", "tenant": "t1", "feature": "logins", "value": 1})).status)

	// Send the item to the simulator; then Stripe fails it after the fact.
	var err error
	s.leases, err = h.parts.Outbox.Claim(h.ctx, h.pool, outbox.ClaimOptions{Owner: "test", Limit: 1})
	require.NoError(t, err)
	require.Len(t, s.leases, 1)
	o := exporter.NewStripeV1(s.client, 2*time.Second).Send(h.ctx, s.leases[0])
	require.Equal(t, outbox.Accepted, o.Kind, "%+v", o)
	o.Lease = s.leases[0]
	_, err = h.parts.Outbox.Record(h.ctx, h.pool, []outbox.Outcome{o})
	require.NoError(t, err)
	require.True(t, s.sim.DropEvent("acct_1", s.leases[0].Identifier))
	s.reports = s.sim.ErrorReports("acct_1")
	require.Len(t, s.reports, 1)
}

// refusesBadDeliveries: a bad or stale signature, or a body changed after
// signing, answers 400 and records nothing.
func (s *webhookScenario) refusesBadDeliveries(t *testing.T, h *harness) {
	body, sig := stripesim.SignedThinEvent(s.reports[0], "whsec_wrong", time.Now())
	resp := s.post(t, h, body, sig)
	require.Equal(t, http.StatusBadRequest, resp.status, "%s", resp)
	require.Equal(t, "invalid_signature", resp.errorCode(t))
	body, sig = stripesim.SignedThinEvent(s.reports[0], webhookSecret, time.Now().Add(-10*time.Minute))
	resp = s.post(t, h, body, sig)
	require.Equal(t, http.StatusBadRequest, resp.status, "a stale signature: %s", resp)
	require.Contains(t, string(resp.body), "older than 300 seconds")
	body, sig = stripesim.SignedThinEvent(s.reports[0], webhookSecret, time.Now().Add(365*24*time.Hour))
	resp = s.post(t, h, body, sig)
	require.Equal(t, http.StatusBadRequest, resp.status, "a signature dated a year ahead: %s", resp)
	require.Contains(t, string(resp.body), "dated in the future")
	resp = s.post(t, h, body, "")
	require.Equal(t, http.StatusBadRequest, resp.status)
	s.body, s.sig = stripesim.SignedThinEvent(s.reports[0], webhookSecret, time.Now())
	resp = s.post(t, h, append(s.body, ' '), s.sig)
	require.Equal(t, http.StatusBadRequest, resp.status, "the body was changed after signing")
	require.Zero(t, s.recorded(h), "nothing recorded from a bad delivery")
}

// recordsOnce: a good delivery fails the item; delivered again, by hand or
// by the simulator's event destination, it changes nothing.
func (s *webhookScenario) recordsOnce(t *testing.T, h *harness) {
	resp := s.post(t, h, s.body, s.sig)
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	require.JSONEq(t, `{"status":"recorded","failed":1,"noted":0,"evidence_only":0,"unmatched":0}`, string(resp.body))
	failed, err := h.parts.Outbox.Get(h.ctx, h.pool, s.leases[0].ID)
	require.NoError(t, err)
	require.Equal(t, outbox.StateQuarantined, failed.State, "Stripe dropped it, with a code Tally does not know: a human looks")
	require.Equal(t, outbox.ReasonProviderRefused, failed.QuarantineReason)
	require.Equal(t, stripesim.CodeDropped, failed.LastError.Code)
	resp = s.post(t, h, s.body, s.sig)
	require.Equal(t, http.StatusOK, resp.status)
	require.JSONEq(t, `{"status":"duplicate"}`, string(resp.body))
	// Delivered again by the simulator's event destination: still once.
	n, err := s.sim.DeliverReports(context.Background(), "acct_1", h.url+"/v1/stripe/events", webhookSecret)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, int64(1), s.recorded(h))
	require.Equal(t, int64(1), h.count(`SELECT count(*) FROM meter_error_evidence WHERE item_id = $1`, s.leases[0].ID))
	again, err := h.parts.Outbox.Get(h.ctx, h.pool, s.leases[0].ID)
	require.NoError(t, err)
	require.Equal(t, failed, again, "a redelivered event changes nothing")
}

func (s *webhookScenario) showsEvidence(t *testing.T, h *harness) {
	resp := h.request(http.MethodGet, "/v1/outbox/items/"+strconv.FormatInt(s.leases[0].ID, 10), s.op, nil)
	var view struct {
		Evidence []struct {
			EventID    string `json:"event_id"`
			EventType  string `json:"event_type"`
			Identifier string `json:"identifier"`
			Code       string `json:"code"`
		} `json:"evidence"`
	}
	resp.decode(t, &view)
	require.Len(t, view.Evidence, 1)
	require.Equal(t, s.reports[0].ID, view.Evidence[0].EventID)
	require.Equal(t, stripeapi.EventMeterErrorReport, view.Evidence[0].EventType)
	require.Equal(t, s.leases[0].Identifier, view.Evidence[0].Identifier)
	require.Equal(t, stripesim.CodeDropped, view.Evidence[0].Code)
}

// ignoresOtherTypes: another event type is acknowledged and ignored.
func (s *webhookScenario) ignoresOtherTypes(t *testing.T, h *harness) {
	other := s.reports[0]
	other.ID, other.Type = "evt_other", "v2.core.event_destination.ping"
	body, sig := stripesim.SignedThinEvent(other, webhookSecret, time.Now())
	resp := s.post(t, h, body, sig)
	require.JSONEq(t, `{"status":"ignored"}`, string(resp.body))
	require.Equal(t, int64(1), s.recorded(h))
}

// Without a signing secret the destination is not configured: 503.
func TestStripeEventsWithoutSecret(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	resp := h.request(http.MethodPost, "/v1/stripe/events", "", `{"id":"evt_1","type":"x"}`)
	require.Equal(t, http.StatusServiceUnavailable, resp.status)
	require.Equal(t, "webhooks_not_configured", resp.errorCode(t))
}

// streamToSim sends events to the simulator's v2 meter event stream as
// Stripe's would receive them: a session, then one stream request. The
// simulator validates them as Stripe does after answering 200, and keeps an
// error report for each kind of failure.
func streamToSim(t *testing.T, base string, events ...map[string]any) {
	t.Helper()
	call := func(path, auth string, body any) []byte {
		b, err := json.Marshal(body)
		require.NoError(t, err)
		req, err := http.NewRequest(http.MethodPost, base+path, bytes.NewReader(b))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+auth)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		out, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", path, out)
		return out
	}
	var sess struct {
		Token string `json:"authentication_token"`
	}
	require.NoError(t, json.Unmarshal(call("/v2/billing/meter_event_session", stripesim.DefaultKey, map[string]any{}), &sess))
	call("/v2/billing/meter_event_stream", sess.Token, map[string]any{"events": events})
}

// reportsScenario is what the steps of
// TestStripeEventsReportsFailAcceptedItems share besides the database.
type reportsScenario struct {
	sim    *stripesim.Server
	simURL string
	op     string
	at     time.Time      // when the usage occurred
	leases []outbox.Lease // the three items claimed
	// noMeter is the item of a feature without a meter at Stripe; late and
	// inFlight are items whose timestamps Stripe finds too far in the past,
	// the first accepted, the second still leased.
	noMeter, late, inFlight outbox.Lease
	reports                 []stripesim.ErrorReport
}

// get reads the item id from the outbox.
func (s *reportsScenario) get(t *testing.T, h *harness, id int64) outbox.Item {
	it, err := h.parts.Outbox.Get(h.ctx, h.pool, id)
	require.NoError(t, err)
	return it
}

// End to end through POST /v1/stripe/events: items Stripe's stream answered
// 200 for are accepted; its error reports then quarantine the one whose
// event name has no meter (meter_not_found, requeueable once the meter
// exists) and reject the one whose timestamp it refused. A leased item the
// report also names keeps its state (evidence only), an identifier Tally
// does not know is counted, conservation holds, and nothing moves twice.
func TestStripeEventsReportsFailAcceptedItems(t *testing.T) {
	t.Parallel()
	sim, simURL, _, h := webhookHarness(t)
	s := &reportsScenario{sim: sim, simURL: simURL}
	// In order, on one database: each step reads the items and reports the
	// steps before it left.
	runSteps(t, h,
		step{"claimed", s.claim},
		step{"accepted, then reported", s.acceptAndReport},
		step{"reports fail accepted items", s.failAccepted},
		step{"delivered again", s.deliverAgain},
		step{"every unit in one state", s.conserves},
		step{"requeue re-addresses", s.requeueReaddresses},
	)
}

// claim ingests an event of exports and two of logins, and claims their
// three items.
func (s *reportsScenario) claim(t *testing.T, h *harness) {
	s.op = h.as(h.token("op", auth.RoleOperator))
	ingest := h.as(h.token("svc", auth.RoleIngest))
	for _, f := range []string{"logins", "exports"} { // no meter at Stripe has the event name exports
		require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/features/"+f, s.op,
			map[string]any{"event_name": f, "aggregation": "count"}).status)
	}
	require.Equal(t, http.StatusOK, h.request(http.MethodPut, "/v1/mappings/tenants/t1", s.op,
		map[string]any{"stripe_customer_id": "cus_1"}).status)
	s.at = time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	require.Equal(t, http.StatusAccepted, h.request(http.MethodPost, "/v1/usage", ingest, batch(
		event{"id": "e1", "tenant": "t1", "feature": "exports", "value": 1, "timestamp": rfc(s.at)},
		event{"id": "e2", "tenant": "t1", "feature": "logins", "value": 1, "timestamp": rfc(s.at)},
		event{"id": "e3", "tenant": "t1", "feature": "logins", "value": 1, "timestamp": rfc(s.at.Add(time.Second))},
	)).status)
	var err error
	s.leases, err = h.parts.Outbox.Claim(h.ctx, h.pool, outbox.ClaimOptions{Owner: "test", Limit: 3, Policy: outbox.BestEffort})
	require.NoError(t, err)
	require.Len(t, s.leases, 3)
	byFeature := map[string][]outbox.Lease{}
	for _, l := range s.leases {
		byFeature[l.Payload.Feature] = append(byFeature[l.Payload.Feature], l)
	}
	s.noMeter, s.late, s.inFlight = byFeature["exports"][0], byFeature["logins"][0], byFeature["logins"][1]
}

// acceptAndReport: the stream answers 200 for every event: the first two
// are accepted (the third's answer is not recorded yet: it stays leased).
// Stripe then finds no meter for exports, and the logins events'
// timestamps too far in the past (as for an event that reached it late).
func (s *reportsScenario) acceptAndReport(t *testing.T, h *harness) {
	_, err := h.parts.Outbox.Record(h.ctx, h.pool, []outbox.Outcome{
		{Lease: s.noMeter, Kind: outbox.Accepted}, {Lease: s.late, Kind: outbox.Accepted}})
	require.NoError(t, err)
	old := rfc(time.Now().Add(-40 * 24 * time.Hour))
	streamed := func(l outbox.Lease, ts string) map[string]any {
		return map[string]any{"event_name": l.Payload.EventName, "identifier": l.Identifier, "timestamp": ts,
			"payload": map[string]any{"stripe_customer_id": l.Payload.Customer, "value": "1"}}
	}
	streamToSim(t, s.simURL,
		streamed(s.noMeter, rfc(s.at)), streamed(s.late, old), streamed(s.inFlight, old),
		map[string]any{"event_name": "logins", "identifier": "another_senders_event", "timestamp": old,
			"payload": map[string]any{"stripe_customer_id": "cus_1", "value": "1"}})
	s.reports = s.sim.ErrorReports("acct_1")
	require.Len(t, s.reports, 2)
}

// failAccepted delivers both reports: the items they name leave accepted
// (T10), and the leased one keeps its state.
func (s *reportsScenario) failAccepted(t *testing.T, h *harness) {
	before := h.count(`SELECT count(*) FROM outbox_attempts`)
	answers := map[string]string{}
	for _, rep := range s.reports {
		body, sig := stripesim.SignedThinEvent(rep, webhookSecret, time.Now())
		req, err := http.NewRequestWithContext(h.ctx, http.MethodPost, h.url+"/v1/stripe/events", bytes.NewReader(body))
		require.NoError(t, err)
		req.Header.Set("Stripe-Signature", sig)
		resp := h.send(req)
		require.Equal(t, http.StatusOK, resp.status, "%s", resp)
		answers[rep.Code] = string(resp.body)
	}
	require.JSONEq(t, `{"status":"recorded","failed":1,"noted":0,"evidence_only":0,"unmatched":0}`, answers[stripesim.CodeNoMeter])
	require.JSONEq(t, `{"status":"recorded","failed":1,"noted":1,"evidence_only":0,"unmatched":1}`, answers[stripesim.CodeTimestampTooFarInPast])

	it := s.get(t, h, s.noMeter.ID)
	require.Equal(t, outbox.StateQuarantined, it.State)
	require.Equal(t, outbox.ReasonMeterNotFound, it.QuarantineReason)
	require.Equal(t, "no_meter", it.LastError.Code)
	require.Equal(t, it.Attempts, it.RefusedAttempts, "its one send was not recorded: it may be re-addressed")
	it = s.get(t, h, s.late.ID)
	require.Equal(t, outbox.StateRejected, it.State)
	require.Equal(t, "timestamp_too_far_in_past", it.LastError.Code)
	require.Equal(t, outbox.StateLeased, s.get(t, h, s.inFlight.ID).State, "noted: its accept lands where the report says")
	require.Equal(t, before, h.count(`SELECT count(*) FROM outbox_attempts`), "T10 is not an attempt's outcome")

	var view struct {
		State    string `json:"state"`
		Evidence []struct {
			Code string `json:"code"`
		} `json:"evidence"`
	}
	h.request(http.MethodGet, "/v1/outbox/items/"+strconv.FormatInt(s.noMeter.ID, 10), s.op, nil).decode(t, &view)
	require.Equal(t, "quarantined", view.State)
	require.Len(t, view.Evidence, 1)
	require.Equal(t, "no_meter", view.Evidence[0].Code)
}

// deliverAgain: Stripe delivers the events again: nothing moves twice.
func (s *reportsScenario) deliverAgain(t *testing.T, h *harness) {
	states := map[int64]outbox.Item{}
	for _, l := range s.leases {
		states[l.ID] = s.get(t, h, l.ID)
	}
	n, err := s.sim.DeliverReports(context.Background(), "acct_1", h.url+"/v1/stripe/events", webhookSecret)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	for _, l := range s.leases {
		require.Equal(t, states[l.ID], s.get(t, h, l.ID))
	}
}

// conserves: every unit is still in exactly one state.
func (s *reportsScenario) conserves(t *testing.T, h *harness) {
	c, err := quarantine.CompletenessOf(h.ctx, h.pool, s.at.Format("2006-01"), "")
	require.NoError(t, err)
	require.True(t, c.Holds, "%+v", c)
	var quarantined, rejected, pending int64
	for _, l := range c.Lines {
		quarantined += l.Quarantined.Events
		rejected += l.Rejected.Events
		pending += l.Pending.Events
	}
	require.Equal(t, [3]int64{1, 1, 1}, [3]int64{quarantined, rejected, pending})
}

// requeueReaddresses: the meter is created at Stripe, no mapping changes,
// and the operator requeues. The report proved Stripe recorded nothing under
// the item's identifier, but Stripe may remember it (a replayed 200, or a
// failed event in its dedup window): a resend under it could read as
// accepted while nothing is counted. The requeue re-addresses it instead: a
// successor with a new identifier, the item superseded.
func (s *reportsScenario) requeueReaddresses(t *testing.T, h *harness) {
	s.sim.CreateMeter("acct_1", stripesim.MeterSpec{DisplayName: "exports", EventName: "exports", Formula: "count"})
	resp := h.request(http.MethodPost, "/v1/outbox/items/"+strconv.FormatInt(s.noMeter.ID, 10)+"/requeue", s.op,
		map[string]any{"mapping_version": s.noMeter.MappingVersion})
	require.Equal(t, http.StatusOK, resp.status, "%s", resp)
	var requeued struct {
		Action    string `json:"action"`
		Successor int64  `json:"successor"`
	}
	resp.decode(t, &requeued)
	require.Equal(t, "readdressed", requeued.Action)
	it := s.get(t, h, s.noMeter.ID)
	require.Equal(t, outbox.StateSuperseded, it.State)
	succ := s.get(t, h, requeued.Successor)
	require.Equal(t, outbox.StatePending, succ.State)
	require.NotEqual(t, s.noMeter.Identifier, succ.Identifier)
	require.Equal(t, s.noMeter.MappingVersion, succ.MappingVersion, "no mapping changed")
}

// TestStripeEventIDsAreValidatedBeforeUse: a correctly signed thin event
// whose id is not of Stripe's shape is refused before the id reaches the
// fetch path; a signature dated slightly ahead (clock skew) is accepted.
func TestStripeEventIDsAreValidatedBeforeUse(t *testing.T) {
	t.Parallel()
	const secret = "whsec_ids"
	sign := func(body string, at time.Time) ([]byte, string) {
		p := webhook.GenerateTestSignedPayload(&webhook.UnsignedPayload{Payload: []byte(body), Secret: secret, Timestamp: at})
		return p.Payload, p.Header
	}
	for _, id := range []string{"", "evt_", "evt_1/../../v1/account", "evt_1?expand=x", "../evt_1", "evt_1 ", "cus_123", "evt_" + strings.Repeat("a", 251)} {
		body, sig := sign(fmt.Sprintf(`{"id":%q,"type":"v1.billing.meter.error_report_triggered"}`, id), time.Now())
		if _, err := api.ParseStripeEvent(body, sig, secret); err == nil {
			t.Errorf("event id %q accepted", id)
		}
	}
	body, sig := sign(`{"id":"evt_test_61SkEWyYqa0lB2mTx","type":"v1.billing.meter.error_report_triggered"}`, time.Now().Add(2*time.Minute))
	ev, err := api.ParseStripeEvent(body, sig, secret)
	require.NoError(t, err, "two minutes of clock skew")
	require.Equal(t, "evt_test_61SkEWyYqa0lB2mTx", ev.ID)
	body, sig = sign(`{"id":"evt_1","type":"v1.billing.meter.error_report_triggered"}`, time.Now().Add(10*time.Minute))
	_, err = api.ParseStripeEvent(body, sig, secret)
	require.ErrorContains(t, err, "dated in the future")

	// stripe-go takes the last t= and ignores a key with a space: a header
	// that puts a present time first must not hide the future one signed.
	body, sig = sign(`{"id":"evt_1","type":"v1.billing.meter.error_report_triggered"}`, time.Now().Add(365*24*time.Hour))
	now := "t=" + strconv.FormatInt(time.Now().Unix(), 10)
	for _, header := range []string{now + "," + sig, " " + now + "," + sig} {
		_, err = api.ParseStripeEvent(body, header, secret)
		require.Error(t, err, "a future-dated signature behind %q", header[:14])
	}
}
