// Package stripesim is a stateful, in-memory HTTP simulator of the Stripe
// endpoints Tally calls. Tests mount [Server.Handler] on an
// httptest.Server and point stripe-go at its URL; `tally stripe-sim` and
// `tally dev` serve it on a local listener.
//
// It answers in exactly the JSON shapes stripe-go decodes — objects, list
// envelopes and Stripe's error envelope with the matching HTTP status — and
// sets a Request-Id header on every response. It reads what stripe-go sends:
// form-encoded bodies with nested keys, Bearer (or Basic) auth, the
// Stripe-Account header for Connect and the Idempotency-Key header on POSTs.
// Like Stripe, it keeps the first answer for a key once the endpoint has
// started executing — 2xx, 5xx and the 4xx found while executing — and
// replays it with Idempotent-Replayed: true for 24 hours; a validation
// error of the parameters, a 429 or a 409 for a key in use leaves the key
// free.
//
// State lives per account (the Stripe-Account header when present, else the
// key's own account) and per mode: objects carry the livemode of the key that
// created them, and a test key never sees live objects or the reverse.
//
// What it must never do: it never talks to the real Stripe or opens any
// outbound connection, it never records or logs an API key (only a masked
// form ever appears, in its own error messages), and it is never used by a
// production code path — its only non-test users are the `stripe-sim` and
// `dev` commands.
//
// Meter events (v1 and the v2 session and stream) are validated like Stripe
// does — an active meter, a known customer, a whole-number value of at most
// 15 digits, the timestamp window and the 24-hour identifier dedup — and
// recorded, so that event summaries, adjustments and the test readbacks
// ([Server.Events], [Server.Aggregate], [Server.RecordedTwice],
// [Server.ErrorReports], [Server.RateLimited]) see them. The stream
// validates asynchronously and reports invalid events in error reports; v1
// does too with [Limits.AsyncValidation], and refuses them at once
// without. [Limits] add Stripe's rate limits — the basic limit of every
// API-key call, each endpoint's default limit, and the meter events' own
// limits (v1 calls and v2 stream requests alike, each with its own token
// bucket) — and injected faults (failures before and after recording,
// lost replies, latency, hangs, asynchronous drops, read failures, a
// customer's lock timeouts) per account, changeable while running with [Server.Configure]. A successful
// stream request is answered 200 with an empty object, as Stripe does;
// [Server.ExpireSessions] ends stream sessions before their 15 minutes.
// Time is the [Options.Now] clock, which tests move.
//
// Error reports are thin events: GET /v2/core/events/{id} serves one in
// full and GET /v2/core/events lists them (newest first, types and created
// filters, next_page_url pages, 30 days back), each only to a request that
// names the account's context — Stripe-Context, which supersedes
// Stripe-Account — for a connected account, whose thin events carry it
// ([ErrorReport.Context]); [Options.Samples] chooses the shape their
// samples name the failed requests in, and [Server.DeliverReports] posts
// them to an event destination, retrying for three days like Stripe.
//
// Errors of /v2 paths keep Stripe's {"error":{"type","code","message"}}
// shape; stripe-go v82 parses them by type into a
// *stripe.TemporarySessionExpiredError (an expired or unknown stream
// session) or a *stripe.V2RawError (everything else, with no HTTP status),
// never a *stripe.Error.
//
// Layout, for extension: one [Server] holding all state behind one mutex
// (server.go), one chi router built in [New] whose middleware chain is, in
// order, request ids, recording, the billing due by now and auth
// (middleware.go), the gate — rate limits, the rate-limit, read and
// lose-reply faults — (limits.go), idempotent replay (idempotency.go), and
// the execute layer — latency, hangs and the failures of an executing
// endpoint — (limits.go); Stripe's error envelope in errors.go, list
// pagination in list.go, and one file per resource (account.go, meters.go,
// customers.go, meterevents.go, summaries.go, adjustments.go, events.go for
// v2 events, stream.go for the v2 session and stream, reports.go for error
// reports, prices.go, subscriptions.go, invoices.go). Billing
// (docs/simulator.md) adds amounts.go (the simulator's own price evaluator),
// periods.go (billing dates from the anchor), billing.go (the billing cycle
// — renewals and finalizations applied lazily in time order at every
// request, by [Server.AdvanceBilling] and by the readbacks [Server.Invoices]
// and [Server.BillingEvents] — and the usage an invoice line bills),
// billingevents.go (v1 snapshot events of subscriptions and invoices, GET
// /v1/events, [Server.DeliverBillingEvents]) and forms.go (the indexed and
// nested form parameters the billing endpoints take).
package stripesim
