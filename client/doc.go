// Package client is the Go client a product service uses to post usage to
// Tally's POST /v1/usage. It owns the request's wire shape, the split of a
// large call into requests within the server's limits, retries, and a
// bounded buffer that batches usage by count, bytes and time.
//
// Two ways in:
//
//   - Post sends events now, as one request (several when they exceed one
//     request's limits: 10,000 events and 5 MiB by default, see
//     WithRequestLimits) and answers once Tally has stored them.
//   - Add puts one event in a buffer that a background sender posts in
//     batches (WithBatchSize, WithBatchBytes, WithFlushInterval). The buffer
//     is bounded (WithBufferSize, WithBufferBytes): when it is full, Add
//     blocks until there is room or its context ends. Flush delivers what was
//     added before it and Close delivers the rest and stops the sender; both
//     say what was not delivered.
//
// Retries. A network error, a 5xx or a 429 is retried with the same request
// body — the same event ids and the same content — after an exponential
// backoff with jitter, or after the server's Retry-After when that is
// longer, until the request succeeds, the retry budget (WithRetryBudget) is
// spent or the context ends. This is safe because Tally deduplicates by
// (tenant, id): an event a lost reply left stored counts as a duplicate when
// it comes again, provided its content is the same. A 400, 401, 403, 413 or
// 422 is never retried: the same body would be refused again. A redirect
// (3xx) is never followed, whatever the HTTP client given, nor retried: it
// would carry the token wherever it points, so the events are reported not
// delivered. Each failure is typed: *InvalidError for a 422 (with the
// server's per-event problems), *RedirectError for a 3xx, *StatusError for
// any other status, all reached with errors.As through the *UndeliveredError
// that Post, Flush and Close return.
//
// Timestamps. An event without a timestamp is stored by Tally with its
// database's clock at the insert, and posting it again without one is a
// duplicate (the server compares the absence of a timestamp, not the time it
// filled in). Post sends events as given. Add stamps an event that has no
// timestamp with the time of the Add, because a buffered event may be sent
// long after it happened (a batch waiting for its interval, a server
// restarting); the stamped event is what every retry sends, and what a
// report of undelivered events hands back, so posting a reported event again
// cannot change its content.
//
// The client never drops an event silently: every event given to Post is
// either answered by a 202 or named in Post's error, and every event
// accepted by Add is either delivered or reported — to the error handler
// (WithErrorHandler; by default a log line) and to the next Flush or Close.
// It never writes the token, an event's content or a response body to a log
// or an error message, never retries a request the server refused as
// invalid, and never changes an event between attempts.
package client
