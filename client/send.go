package client

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// maxAnswerBytes bounds what is read of an answer: a 422 with Tally's 100
// problems is a few kilobytes.
const maxAnswerBytes = 1 << 20

// userAgent names the client to the server's access log.
const userAgent = "tally-go-client"

// send posts one request body until it is answered 202, retrying network
// errors (but for a server certificate that does not verify), 5xx and 429
// with the same body — after the backoff, or the server's Retry-After when
// longer — while the retry budget and ctx last.
func (c *Client) send(ctx context.Context, body []byte) (Result, error) {
	b := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(c.cfg.backoffInitial),
		backoff.WithMaxInterval(c.cfg.backoffMax),
		backoff.WithMultiplier(2),
		backoff.WithRandomizationFactor(0.5),
		backoff.WithMaxElapsedTime(c.cfg.retryBudget),
	)
	var last error // the previous attempt's failure
	for attempt := 1; ; attempt++ {
		res, err := c.attempt(ctx, body)
		if err == nil {
			return res, nil
		}
		if ctx.Err() != nil {
			if last == nil {
				return Result{}, fmt.Errorf("client: %w during attempt %d: %w", ctx.Err(), attempt, err)
			}
			return Result{}, fmt.Errorf("client: %w during attempt %d; the one before failed: %w", ctx.Err(), attempt, last)
		}
		last = err
		var (
			status *StatusError
			cert   *tls.CertificateVerificationError
		)
		isStatus := errors.As(err, &status)
		if isStatus && !status.retryable() || errors.As(err, &cert) {
			return Result{}, err
		}
		wait := b.NextBackOff()
		if c.cfg.retryBudget == 0 {
			wait = backoff.Stop
		}
		if isStatus && wait != backoff.Stop && status.RetryAfter > wait {
			wait = status.RetryAfter
			if b.GetElapsedTime()+wait > c.cfg.retryBudget {
				wait = backoff.Stop
			}
		}
		if wait == backoff.Stop {
			return Result{}, fmt.Errorf("%w after %d attempts in %s: %w", ErrRetryBudgetSpent, attempt,
				b.GetElapsedTime().Round(time.Millisecond), err)
		}
		c.log.Warn("tally client: retrying POST /v1/usage", "attempt", attempt, "cause", cause(err), "wait", wait.Round(time.Millisecond))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return Result{}, fmt.Errorf("client: %w while waiting to retry (attempt %d: %w)", ctx.Err(), attempt, err)
		case <-t.C:
		}
	}
}

// cause is a failure as a log line names it: the status and code, the
// context's end, or the network error (which names the URL, never a
// header); never the answer's text.
func cause(err error) string {
	s := "network error"
	var (
		status *StatusError
		uerr   *url.Error
	)
	switch {
	case errors.As(err, &status):
		s = strconv.Itoa(status.StatusCode)
		if status.Code != "" {
			s += " " + status.Code
		}
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		s = "context ended"
	case errors.Is(err, errAborted):
		s = "closed before sent"
	case errors.Is(err, ErrEventTooLarge):
		s = "event too large"
	case errors.As(err, &uerr):
		s = "network error: " + uerr.Err.Error()
	}
	if errors.Is(err, ErrRetryBudgetSpent) {
		s = "retry budget spent, the last attempt: " + s
	}
	return s
}

// attempt posts body once. A transport error, or a 202 whose answer could
// not be read, is returned as is (both retryable: the events, stored or
// not, are posted again with the same ids); a 3xx, never followed, as a
// *RedirectError; any other status as a *StatusError or, for a 422, an
// *InvalidError.
func (c *Client) attempt(ctx context.Context, body []byte) (Result, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.endpoint, bytes.NewReader(body))
	if err != nil {
		return Result{}, fmt.Errorf("client: building the request: %w", err)
	}
	req.Header.Set("Authorization", "Bearer "+c.token)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", userAgent)
	resp, err := c.cfg.httpClient.Do(req)
	if err != nil {
		return Result{}, err // a *url.Error: the URL without credentials, never a header
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswerBytes))
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxAnswerBytes)) // let the connection be reused
	if resp.StatusCode == http.StatusAccepted {
		var res Result
		if err == nil {
			err = json.Unmarshal(answer, &res)
		}
		if err != nil {
			return Result{}, fmt.Errorf("client: reading the answer to POST /v1/usage: %w", err)
		}
		return res, nil
	}
	if resp.StatusCode >= 300 && resp.StatusCode < 400 {
		return Result{}, redirectError(resp)
	}
	return Result{}, statusError(resp, answer)
}

// redirectError reads a 3xx: its status and where its Location points,
// scheme and host only (a path or query may carry what is not ours to log).
func redirectError(resp *http.Response) error {
	e := &RedirectError{StatusError: StatusError{StatusCode: resp.StatusCode}}
	if loc, err := resp.Location(); err == nil {
		e.Location = loc.Scheme + "://" + loc.Host
	}
	return e
}

// statusError reads an answer other than 202: Tally's error shape,
// {"error":{"code","message","problems"}}, when it is one.
func statusError(resp *http.Response, answer []byte) error {
	var shape struct {
		Error struct {
			Code     string    `json:"code"`
			Message  string    `json:"message"`
			Problems []Problem `json:"problems"`
		} `json:"error"`
	}
	se := StatusError{StatusCode: resp.StatusCode, RetryAfter: retryAfter(resp.Header.Get("Retry-After"), time.Now())}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") && json.Unmarshal(answer, &shape) == nil {
		se.Code, se.Message = shape.Error.Code, shape.Error.Message
	}
	if resp.StatusCode == http.StatusUnprocessableEntity {
		return &InvalidError{StatusError: se, Problems: shape.Error.Problems}
	}
	return &se
}

// retryAfter reads a Retry-After header: whole seconds or an HTTP date.
// Anything else, and a date in the past, is no wait.
func retryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs <= 0 {
			return 0
		}
		const maxSecs = int64(24 * time.Hour / time.Second)
		return time.Duration(min(secs, maxSecs)) * time.Second
	}
	if at, err := http.ParseTime(v); err == nil && at.After(now) {
		return at.Sub(now)
	}
	return 0
}
