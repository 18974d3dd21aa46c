package client

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"
)

// The server's limits of one POST /v1/usage, the defaults of
// WithRequestLimits.
const (
	// MaxRequestEvents is the most events Tally takes in one request
	// (TALLY_INGEST_MAX_EVENTS, whose default and ceiling it is).
	MaxRequestEvents = 10_000
	// MaxRequestBytes is the largest request body Tally takes: 5 MiB.
	MaxRequestBytes = 5 << 20
)

// Defaults of the options.
const (
	// DefaultBatchSize is the most events of one buffered batch.
	DefaultBatchSize = 1_000
	// DefaultBatchBytes is the largest body of one buffered batch.
	DefaultBatchBytes = 1 << 20
	// DefaultFlushInterval is the longest an added event waits for its
	// batch to fill before it is sent.
	DefaultFlushInterval = time.Second
	// DefaultBufferSize is the most events the buffer holds.
	DefaultBufferSize = 10_000
	// DefaultBufferBytes is the most encoded bytes the buffer holds.
	DefaultBufferBytes = 8 << 20
	// DefaultRetryBudget is how long one request is retried.
	DefaultRetryBudget = 2 * time.Minute
	// DefaultBackoffInitial is the first wait before a retry (randomised by
	// half either way); each wait doubles it up to DefaultBackoffMax.
	DefaultBackoffInitial = 100 * time.Millisecond
	// DefaultBackoffMax is the longest wait between attempts, unless the
	// server's Retry-After asks for longer.
	DefaultBackoffMax = 10 * time.Second
	// DefaultTimeout bounds one attempt (its http.Client's Timeout) when
	// WithHTTPClient is not given.
	DefaultTimeout = 30 * time.Second
)

// Option configures a Client; New reports every invalid option at once.
type Option func(*config)

// config is a Client's settings, every default filled in by New.
type config struct {
	httpClient     *http.Client
	batchSize      int
	batchBytes     int
	flushInterval  time.Duration
	bufferSize     int
	bufferBytes    int
	requestEvents  int
	requestBytes   int
	retryBudget    time.Duration
	backoffInitial time.Duration
	backoffMax     time.Duration
	logger         *slog.Logger
	onError        func(*UndeliveredError)
	now            func() time.Time
}

func defaultConfig() config {
	return config{
		httpClient:     &http.Client{Timeout: DefaultTimeout},
		batchSize:      DefaultBatchSize,
		batchBytes:     DefaultBatchBytes,
		flushInterval:  DefaultFlushInterval,
		bufferSize:     DefaultBufferSize,
		bufferBytes:    DefaultBufferBytes,
		requestEvents:  MaxRequestEvents,
		requestBytes:   MaxRequestBytes,
		retryBudget:    DefaultRetryBudget,
		backoffInitial: DefaultBackoffInitial,
		backoffMax:     DefaultBackoffMax,
		now:            time.Now,
	}
}

// validate reports every problem of the settings at once.
func (c *config) validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.httpClient == nil {
		bad("the HTTP client is nil")
	}
	if c.requestEvents < 1 || c.requestEvents > MaxRequestEvents {
		bad("a request's events must be 1 to %d, not %d", MaxRequestEvents, c.requestEvents)
	}
	if minBody := bodySize(1, 2); c.requestBytes < minBody || c.requestBytes > MaxRequestBytes {
		bad("a request's bytes must be %d to %d, not %d", minBody, MaxRequestBytes, c.requestBytes)
	}
	if c.batchSize < 1 || c.batchSize > c.requestEvents {
		bad("the batch size must be 1 to a request's events (%d), not %d", c.requestEvents, c.batchSize)
	}
	if c.batchBytes < bodySize(1, 2) || c.batchBytes > c.requestBytes {
		bad("the batch bytes must be %d to a request's bytes (%d), not %d", bodySize(1, 2), c.requestBytes, c.batchBytes)
	}
	if c.flushInterval <= 0 {
		bad("the flush interval must be positive, not %s", c.flushInterval)
	}
	if c.bufferSize < c.batchSize {
		bad("the buffer (%d events) must hold at least a batch (%d events)", c.bufferSize, c.batchSize)
	}
	if c.bufferBytes < c.batchBytes {
		bad("the buffer (%d bytes) must hold at least a batch (%d bytes)", c.bufferBytes, c.batchBytes)
	}
	if c.retryBudget < 0 {
		bad("the retry budget must not be negative, not %s", c.retryBudget)
	}
	if c.backoffInitial <= 0 || c.backoffMax < c.backoffInitial {
		bad("the backoff must be positive and its maximum (%s) at least its first wait (%s)", c.backoffMax, c.backoffInitial)
	}
	return errors.Join(errs...)
}

// WithHTTPClient sends the requests with hc: its Transport (proxies, TLS)
// and its Timeout, which bounds each attempt. Give it a Timeout: a server
// that stops answering would otherwise hold an attempt until the context
// ends. The client sends with a copy of hc that follows no redirect, whatever
// hc's CheckRedirect; hc itself is not changed. Defaults to an http.Client
// with a Timeout of DefaultTimeout.
func WithHTTPClient(hc *http.Client) Option { return func(c *config) { c.httpClient = hc } }

// WithBatchSize sets the most events of one buffered batch: a batch is sent
// once it holds that many. At most a request's events (WithRequestLimits).
// Defaults to DefaultBatchSize.
func WithBatchSize(events int) Option { return func(c *config) { c.batchSize = events } }

// WithBatchBytes sets the largest request body of one buffered batch: a
// batch is sent once the next event would not fit. At most a request's
// bytes (WithRequestLimits); an event that alone does not fit is refused
// by Add with ErrEventTooLarge. Defaults to DefaultBatchBytes.
func WithBatchBytes(n int) Option { return func(c *config) { c.batchBytes = n } }

// WithFlushInterval sets the longest an added event waits for its batch to
// fill: a batch is sent when its first event is that old. Defaults to
// DefaultFlushInterval.
func WithFlushInterval(d time.Duration) Option { return func(c *config) { c.flushInterval = d } }

// WithBufferSize sets the most events the buffer holds, counting those
// being sent: Add blocks while it is full. At least the batch size.
// Defaults to DefaultBufferSize. It also bounds the undelivered events kept
// for Flush and Close to list.
func WithBufferSize(events int) Option { return func(c *config) { c.bufferSize = events } }

// WithBufferBytes sets the most encoded bytes the buffer holds, counting
// those being sent: Add blocks while the next event would not fit. At
// least the batch bytes. Defaults to DefaultBufferBytes.
func WithBufferBytes(n int) Option { return func(c *config) { c.bufferBytes = n } }

// WithRequestLimits sets the most events and bytes one request carries:
// Post splits a larger call into several requests. Lower them to match a
// server whose TALLY_INGEST_MAX_EVENTS is lower than the default; a request
// over the server's limits is answered 413 and not retried. Defaults to
// MaxRequestEvents and MaxRequestBytes, the server's own limits.
func WithRequestLimits(events, bytes int) Option {
	return func(c *config) { c.requestEvents, c.requestBytes = events, bytes }
}

// WithRetryBudget sets how long one request is retried after a network
// error, a 5xx or a 429, counted from its first attempt; 0 never retries.
// The context of the call (for Add's batches, Close's) bounds it too.
// Defaults to DefaultRetryBudget.
func WithRetryBudget(d time.Duration) Option { return func(c *config) { c.retryBudget = d } }

// WithBackoff sets the first wait before a retry and the longest: each
// wait doubles, randomised by half either way, up to max; a longer
// Retry-After from the server wins. Defaults to DefaultBackoffInitial and
// DefaultBackoffMax.
func WithBackoff(initial, max time.Duration) Option {
	return func(c *config) { c.backoffInitial, c.backoffMax = initial, max }
}

// WithLogger logs retries (Warn) and, without an error handler, events not
// delivered (Error). Its lines never carry the token, events or response
// bodies: counts, statuses and error codes. Defaults to slog.Default().
func WithLogger(l *slog.Logger) Option { return func(c *config) { c.logger = l } }

// WithErrorHandler calls f with the events of each buffered batch that were
// not delivered, from the sender's goroutine, before the Flush or Close
// that lists them returns. f must return promptly and must not call Add,
// Flush or Close: they may wait for the sender, which waits for f.
// Defaults to logging their count and cause with the logger.
func WithErrorHandler(f func(*UndeliveredError)) Option { return func(c *config) { c.onError = f } }
