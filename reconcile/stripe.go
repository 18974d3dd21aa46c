package reconcile

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/tallymeter/tally/exporter"
	"github.com/tallymeter/tally/internal/stripeapi"
	"github.com/tallymeter/tally/outbox"
)

// read runs a Stripe read of the run (retryRead).
func (r *Reconciler) read(ctx context.Context, f func() error) error {
	return retryRead(ctx, r.cfg.Limiter, r.cfg.Logger, r.cfg.RetryInitial, r.cfg.RetryMax, f)
}

// retryRead runs a Stripe read, again with exponential backoff and jitter
// after a transient failure (429 — which also slows limiter — 409, 5xx, no
// answer), until it succeeds, fails for good, or max has passed.
func retryRead(ctx context.Context, limiter *exporter.Limiter, logger *slog.Logger, initial, max time.Duration, f func() error) error {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxElapsedTime = initial, max
	return backoff.Retry(func() error {
		sent := time.Now()
		err := f()
		if err == nil || ctx.Err() != nil {
			return err
		}
		code, status, _ := stripeapi.Describe(err)
		switch {
		case status == http.StatusTooManyRequests:
			limiter.Slow(sent)
		case status >= 500, status == http.StatusConflict, code == stripeapi.CodeNetwork, code == stripeapi.CodeTimeout:
		default:
			return backoff.Permanent(err)
		}
		logger.Debug("reconcile: a Stripe read failed; trying again", "status", status)
		return err
	}, backoff.WithContext(b, ctx))
}

// refusedKey says whether err, the end of a key's summaries read, is
// Stripe refusing that key alone — a 4xx about the request (400, 404: a
// customer Stripe does not know or deleted, a meter it no longer has; 402,
// …) — and gives the refusal, content-free: Stripe's code (else its error
// type) and the status. 401 and 403 refuse the key Tally calls with, so
// every key (the run fails); 409 and 429 are transient (read retries them);
// a cancelled run is not a refusal.
func refusedKey(ctx context.Context, err error) (outbox.ErrorInfo, bool) {
	if err == nil || ctx.Err() != nil {
		return outbox.ErrorInfo{}, false
	}
	code, status, _ := stripeapi.Describe(err)
	switch {
	case status < 400 || status > 499:
		return outbox.ErrorInfo{}, false
	case status == http.StatusUnauthorized, status == http.StatusForbidden,
		status == http.StatusConflict, status == http.StatusTooManyRequests:
		return outbox.ErrorInfo{}, false
	}
	return outbox.ErrorInfo{Code: code, Status: status}.Sanitized(), true
}
