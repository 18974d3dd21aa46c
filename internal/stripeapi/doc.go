// Package stripeapi builds Tally's stripe-go client and holds the Stripe
// read calls that are not on the export path: the account behind a key,
// the billing meters and the meter of an event name, whether the account
// has a customer, and v2 events — one read in the context its thin event
// names (Stripe-Context), a page of a listing — with their meter error
// reports read from the raw JSON.
//
// What it never does: it never retries on its own (stripe-go runs with
// MaxNetworkRetries 0 — retrying belongs to the outbox), it never logs (its
// stripe-go logger discards everything, telemetry is off) and it never puts a
// key, a request body or a response body into an error. Stripe failures come
// back as *[Error], which carries the HTTP status, Stripe's error type and
// code, the parameter and the request id; [Describe] adds at most 200
// sanitised characters of Stripe's message.
package stripeapi
