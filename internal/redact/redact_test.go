package redact

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestMessageRemovesSecretsControlsAndLength(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, in, want string
	}{
		{"stripe key", "bad key sk_live_abc123 used", "bad key [redacted] used"},
		{"webhook secret", "whsec_abcdef", "[redacted]"},
		{"bearer", "Authorization: Bearer xyz.abc", "Authorization: [redacted]"},
		{"tally token", "token tly_tok_0123 refused", "token [redacted] refused"},
		{"controls and spaces", "a\x00b\n\n  c", "ab c"},
		{"plain", "no such customer", "no such customer"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			if got := Message(c.in); got != c.want {
				t.Fatalf("Message(%q) = %q, want %q", c.in, got, c.want)
			}
		})
	}
	long := Message(strings.Repeat("é ", 300))
	if n := utf8.RuneCountInString(long); n != MaxMessage || !strings.HasSuffix(long, "…") {
		t.Fatalf("a long message keeps %d characters (%q…), want %d ending in …", n, long[:10], MaxMessage)
	}
}

func TestCodeIsAToken(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"":                                       "error",
		"  Stripe 5xx ":                          "stripe_5xx",
		"sk_test_abc":                            "redacted",
		"--":                                     "error",
		strings.Repeat("ab.", 30):                strings.Repeat("ab.", 21) + "a",
		strings.Repeat("a", 40):                  "redacted",                             // a long run reads as a secret
		"meter_event_dimension_count_too_high":   "meter_event_dimension_count_too_high", // Stripe's words
		"sk_live_abcdefghijklmnopqrstuvwxyz":     "redacted",
		"abcdefghij_klmnopqrstuvwxyzabcdefghijk": "redacted", // a word over 24 letters
	} {
		if got := Code(in); got != want {
			t.Errorf("Code(%q) = %q, want %q", in, got, want)
		}
	}
}
