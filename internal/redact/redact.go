// Package redact owns the one scrubber every stored error, reason and log
// line passes through: it folds a code to a token, strips anything that
// looks like a secret (Stripe keys, webhook secrets, bearer and Tally
// tokens, long base64 or hex runs) and control characters from a message,
// and cuts it to MaxMessage characters.
//
// It is a leaf: it imports nothing of Tally, so the outbox (error columns),
// audit (reasons), reconcile and doctor share it without importing each
// other. It must never keep what it removes or log it.
package redact

import (
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"
)

// MaxMessage is the most characters of message Message keeps.
const MaxMessage = 200

var (
	codeInvalid = regexp.MustCompile(`[^a-z0-9_.:-]+`)
	// secretish matches tokens that look like credentials: Stripe keys and
	// webhook secrets, bearer tokens, Tally tokens, long base64/hex runs.
	secretish = regexp.MustCompile(`(?i)(?:sk|rk|pk)_(?:live|test)_[a-z0-9_*]*|\b(?:sk|rk|pk|whsec|tly_tok)_[a-z0-9_*]+|\bbearer\s+\S+|\b[a-z0-9+/=_-]{32,}\b`)
	// keyish matches the credentials secretish names by their prefix.
	keyish = regexp.MustCompile(`(?i)(?:sk|rk|pk)_(?:live|test)_|\b(?:sk|rk|pk|whsec|tly_tok)_|\bbearer\s`)
	spaces = regexp.MustCompile(`\s+`)
	// wordCode is the shape of a provider's error code: lower-case words
	// joined by underscores (meter_event_dimension_count_too_high), long
	// as a run but nothing like a credential.
	wordCode = regexp.MustCompile(`^[a-z]{1,24}(?:_[a-z]{1,24})+$`)
)

// Code folds s to a lower-case token of at most 64 characters of
// [a-z0-9_.:-] with anything secret-looking replaced by "redacted"; "error"
// when nothing is left. A code of lower-case words joined by underscores
// is kept as it is, however long its run.
func Code(s string) string {
	if t := strings.TrimSpace(s); len(t) <= 64 && wordCode.MatchString(t) && !keyish.MatchString(t) {
		return t
	}
	code := secretish.ReplaceAllString(s, "redacted")
	code = codeInvalid.ReplaceAllString(strings.ToLower(strings.TrimSpace(code)), "_")
	code = strings.Trim(code, "_.:-")
	if code == "" {
		code = "error"
	}
	if len(code) > 64 {
		code = code[:64]
	}
	return code
}

// Message strips s of control characters, of anything that looks like a
// secret (replaced by "[redacted]") and of runs of whitespace, and cuts it
// to MaxMessage characters (the last one "…" when cut).
func Message(s string) string {
	msg := strings.Map(func(r rune) rune {
		if r == utf8.RuneError || (unicode.IsControl(r) && !unicode.IsSpace(r)) {
			return -1
		}
		return r
	}, s)
	msg = secretish.ReplaceAllString(msg, "[redacted]")
	msg = strings.TrimSpace(spaces.ReplaceAllString(msg, " "))
	if utf8.RuneCountInString(msg) > MaxMessage {
		r := []rune(msg)
		msg = string(r[:MaxMessage-1]) + "…"
	}
	return msg
}
