// Package stripesim is a stateful, in-memory HTTP simulator of the Stripe
// endpoints Tally calls. Tests mount [Server.Handler] on an
// httptest.Server and point stripe-go at its URL; `tally stripe-sim` and
// `tally dev` serve it on a local listener.
//
// It answers in exactly the JSON shapes stripe-go decodes — objects, list
// envelopes and Stripe's error envelope with the matching HTTP status — and
// sets a Request-Id header on every response. It reads what stripe-go sends:
// form-encoded bodies with nested keys, Bearer (or Basic) auth, the
// Stripe-Account header for Connect and the Idempotency-Key header on POSTs,
// whose successful responses it replays like Stripe does.
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
// does — an active meter, a known customer, a whole-number value, the
// timestamp window and the 24-hour identifier dedup — and recorded, so that
// event summaries, adjustments and the test readbacks ([Server.Events],
// [Server.Aggregate], [Server.RecordedTwice], [Server.ErrorReports]) see
// them. [Limits] add Stripe's rate limits and injected faults (failures
// before recording, lost replies, latency, hangs, asynchronous drops) per
// account to the meter-event calls — v1 calls and v2 stream requests alike,
// each with its own token bucket — changeable while running with
// [Server.Configure]. A successful stream request is answered 200 with an
// empty object, as Stripe does; [Server.ExpireSessions] ends stream
// sessions before their 15 minutes. Time is the [Options.Now] clock, which
// tests move.
//
// Errors of /v2 paths keep Stripe's {"error":{"type","code","message"}}
// shape; stripe-go v82 parses them by type into a
// *stripe.TemporarySessionExpiredError (an expired or unknown stream
// session) or a *stripe.V2RawError (everything else, with no HTTP status),
// never a *stripe.Error.
//
// Layout, for extension: one [Server] holding all state behind one mutex
// (server.go), one chi router built in [New], request ids, recording and
// auth in middleware.go, limits and faults of meter-event calls in
// limits.go (a middleware before the idempotency layer), idempotent replay
// in idempotency.go, Stripe's error envelope in errors.go, list pagination
// in list.go, and one file per resource (account.go, meters.go,
// customers.go, meterevents.go, summaries.go, adjustments.go, stream.go for
// the v2 session and stream, reports.go for error reports).
package stripesim
