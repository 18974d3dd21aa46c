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
// Layout, for extension: one [Server] holding all state behind one mutex
// (server.go), one chi router built in [New], request ids, recording and
// auth in middleware.go, idempotent replay in idempotency.go, Stripe's error
// envelope in errors.go, list pagination in list.go, and one file per
// resource (account.go, meters.go).
package stripesim
