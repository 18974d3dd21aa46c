package stripeapi

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/stripe/stripe-go/v82"
)

// Codes of an [Error] that has no Stripe error code of its own.
const (
	CodeNetwork     = "network_error"  // no response: connection, TLS, DNS
	CodeTimeout     = "timeout"        // deadline or client timeout
	CodeCanceled    = "canceled"       // the context was canceled
	CodeBadResponse = "bad_response"   // a response stripe-go could not read
	CodeFailed      = "request_failed" // any other failure of a Stripe call
	// CodeInvalidConfig is what Describe gives for an error of New.
	CodeInvalidConfig = "invalid_config"

	codeUnknown     = "unknown_error" // Describe of an error from elsewhere
	maxMessageRunes = 200
)

// Error is a failed Stripe call, content-free: it never holds the key or a
// request or response body. Its text names the status, type, code, param
// and request id; Stripe's message, sanitised, is only given by [Describe].
type Error struct {
	// HTTPStatus is the response status; 0 when there was no response.
	HTTPStatus int
	// Type is Stripe's error type (invalid_request_error, api_error, ...);
	// empty when Stripe gave no error object.
	Type string
	// Code is Stripe's error code (resource_missing, ...), empty when
	// Stripe gave none, or one of the Code constants when the call failed
	// without a Stripe error.
	Code string
	// Param is the request parameter Stripe blamed, if any.
	Param string
	// RequestID is Stripe's Request-Id, if there was a response.
	RequestID string

	message string // sanitised, at most maxMessageRunes
	cause   error  // context.Canceled or context.DeadlineExceeded, for errors.Is
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("stripe: ")
	local := true
	switch e.Code {
	case CodeNetwork:
		b.WriteString("network error, no response")
	case CodeTimeout:
		b.WriteString("request timed out")
	case CodeCanceled:
		b.WriteString("request canceled")
	case CodeBadResponse:
		b.WriteString("unreadable response")
	case CodeFailed:
		b.WriteString("request failed")
	default:
		local = false
		b.WriteString("error")
	}
	if e.HTTPStatus != 0 {
		fmt.Fprintf(&b, ", HTTP %d", e.HTTPStatus)
	}
	if e.Type != "" {
		b.WriteString(", type " + e.Type)
	}
	if !local && e.Code != "" {
		b.WriteString(", code " + e.Code)
	}
	if e.Param != "" {
		b.WriteString(", param " + e.Param)
	}
	if e.RequestID != "" {
		b.WriteString(", request " + e.RequestID)
	}
	return b.String()
}

// Unwrap gives context.Canceled or context.DeadlineExceeded when the call
// ended with one, so errors.Is works; nothing else is kept.
func (e *Error) Unwrap() error { return e.cause }

// WrapError turns an error of a stripe-go call into a content-free *[Error]
// (nil stays nil; an *Error, even wrapped, is returned unchanged). Use it on
// every error of calls made through [Client.Stripe].
func WrapError(err error) error {
	if err == nil {
		return nil
	}
	var own *Error
	if errors.As(err, &own) {
		return err
	}
	return wrap(err)
}

var deserializeStatus = regexp.MustCompile(`^Couldn't deserialize JSON \(response status: (\d+)`)

func wrap(err error) *Error {
	var se *stripe.Error
	if errors.As(err, &se) {
		return &Error{
			HTTPStatus: se.HTTPStatusCode, Type: sanitize(string(se.Type)), Code: sanitize(string(se.Code)),
			Param: sanitize(se.Param), RequestID: sanitize(se.RequestID), message: sanitize(se.Msg),
		}
	}
	var v2 *stripe.V2RawError
	if errors.As(err, &v2) {
		e := &Error{Code: sanitize(v2.Code), message: sanitize(v2.Message)}
		if v2.Type != nil {
			e.Type = sanitize(string(*v2.Type))
		}
		return e
	}
	var tse *stripe.TemporarySessionExpiredError
	if errors.As(err, &tse) {
		e := &Error{Type: sanitize(string(tse.Type)), Code: sanitize(tse.Code), message: sanitize(tse.Message)}
		if r := tse.LastResponse; r != nil {
			e.HTTPStatus, e.RequestID = r.StatusCode, sanitize(r.RequestID)
		}
		return e
	}
	var ne net.Error
	var ue *url.Error
	switch {
	case errors.Is(err, context.Canceled):
		return &Error{Code: CodeCanceled, cause: context.Canceled}
	case errors.Is(err, context.DeadlineExceeded):
		return &Error{Code: CodeTimeout, cause: context.DeadlineExceeded}
	case errors.As(err, &ne) && ne.Timeout():
		return &Error{Code: CodeTimeout}
	case errors.As(err, &ue):
		return &Error{Code: CodeNetwork}
	}
	// stripe-go reports an unreadable body with a sample of it; keep the
	// status only.
	if m := deserializeStatus.FindStringSubmatch(err.Error()); m != nil {
		status, _ := strconv.Atoi(m[1])
		return &Error{Code: CodeBadResponse, HTTPStatus: status}
	}
	// Anything else (an error body without an error object comes back as
	// the raw body) is reported without its text.
	return &Error{Code: CodeFailed}
}

// Describe sums up an error for people: a code (Stripe's error code, else
// its error type, else one of the Code constants), the HTTP status (0 when
// there was none) and at most 200 sanitised characters of Stripe's message
// or, without one, of the error's content-free text. Keys in the message
// are masked like Stripe masks them. A nil error gives zero values. It is
// meant for errors of this package and of stripe-go; any other error is
// described as unknown_error, without its text. Errors of [New] give
// invalid_config and their (value-free) text.
func Describe(err error) (code string, status int, message string) {
	if err == nil {
		return "", 0, ""
	}
	var ce configError
	if errors.As(err, &ce) {
		return CodeInvalidConfig, 0, sanitize(ce.Error())
	}
	var e *Error
	if !errors.As(err, &e) {
		if !fromStripe(err) {
			return codeUnknown, 0, "unknown error"
		}
		e = wrap(err)
	}
	code = e.Code
	if code == "" {
		code = e.Type
	}
	if code == "" {
		code = CodeFailed
	}
	message = e.message
	if message == "" {
		message = sanitize(e.Error())
	}
	return code, e.HTTPStatus, message
}

var (
	stripeKeyRE = regexp.MustCompile(`\b((?:sk|rk|pk)_(?:live|test)_)([0-9A-Za-z]+)`)
	otherKeyRE  = regexp.MustCompile(`\b(whsec_|ek_(?:live|test)_)[0-9A-Za-z]+`)
	// A meter event session token (mesk_…) is masked whole, whatever its
	// mode part or alphabet.
	sessionTokenRE = regexp.MustCompile(`\bmesk_[0-9A-Za-z_\-]+`)
	authRE         = regexp.MustCompile(`(?i)\b(bearer|basic)\s+[^\s'",]+`)
)

// fromStripe reports whether err is one of the errors stripe-go returns
// that wrap recognises.
func fromStripe(err error) bool {
	var se *stripe.Error
	var v2 *stripe.V2RawError
	var tse *stripe.TemporarySessionExpiredError
	var ue *url.Error
	return errors.As(err, &se) || errors.As(err, &v2) || errors.As(err, &tse) || errors.As(err, &ue) ||
		errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) ||
		deserializeStatus.MatchString(err.Error())
}

// configError is an invalid Config, reported by New. Its text is fixed and
// names no value.
type configError string

func (e configError) Error() string { return "stripeapi: " + string(e) }

// sanitize makes text fit to show: API keys masked like Stripe does
// (prefix and last four), webhook secrets and credentials removed, control
// characters and runs of white space reduced to one space, at most 200
// characters.
func sanitize(s string) string {
	s = strings.ToValidUTF8(s, "")
	s = stripeKeyRE.ReplaceAllStringFunc(s, func(k string) string {
		m := stripeKeyRE.FindStringSubmatch(k)
		prefix, rest := m[1], m[2]
		if len(rest) <= 8 {
			return prefix + "****"
		}
		return prefix + "****" + rest[len(rest)-4:]
	})
	s = otherKeyRE.ReplaceAllString(s, "${1}****")
	s = sessionTokenRE.ReplaceAllString(s, "mesk_****")
	s = authRE.ReplaceAllString(s, "${1} ****")
	s = strings.Join(strings.FieldsFunc(s, func(r rune) bool {
		return unicode.IsSpace(r) || unicode.IsControl(r)
	}), " ")
	if utf8.RuneCountInString(s) > maxMessageRunes {
		r := []rune(s)
		s = string(r[:maxMessageRunes-1]) + "…"
	}
	return s
}

// CodeAccountInvalid is Stripe's error code for a Stripe-Account the key
// may not act for (stripe-go's ErrorCodeAccountInvalid).
const CodeAccountInvalid = "account_invalid"

// InvalidAccount reports whether err is Stripe's account_invalid: the key
// may not act for the Stripe-Account of the call. Stripe's pages give the
// code, not the status (docs/stripe.md), so any 4xx counts.
func InvalidAccount(err error) bool {
	code, status, _ := Describe(err)
	return code == CodeAccountInvalid && status >= 400 && status < 500
}

// AccessRefused reports whether err, from a call made for a connected
// account, says the key may not act for it: account_invalid, or a 401 or
// 403.
func AccessRefused(err error) bool {
	if err == nil {
		return false
	}
	_, status, _ := Describe(err)
	return InvalidAccount(err) || status == http.StatusUnauthorized || status == http.StatusForbidden
}

// NotFound reports whether err is Stripe's answer that the object does not
// exist in the account asked (404 resource_missing).
func NotFound(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.HTTPStatus == http.StatusNotFound && e.Code == string(stripe.ErrorCodeResourceMissing)
}
