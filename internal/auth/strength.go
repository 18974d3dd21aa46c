package auth

import (
	"fmt"
	"math"
	"unicode"
)

// The rules a configured secret (TALLY_ADMIN_TOKEN) must meet. A token Tally
// generates is 256 random bits and meets them all; these refuse a value a
// person chose: short, made of few characters, or a word repeated.
const (
	// MinSecretLength is the fewest characters a configured secret has.
	MinSecretLength = 32
	// MinSecretDistinct is the fewest different characters it uses. 32
	// random hexadecimal digits fall below it about once in 16,000 draws.
	MinSecretDistinct = 10
	// MinSecretBits is the least entropy it may have, estimated from its
	// length and the kinds of character it uses (lower case, upper case,
	// digits, others).
	MinSecretBits = 128
)

// MinAdminTokenLength is the shortest TALLY_ADMIN_TOKEN accepted; the
// other rules are CheckConfiguredSecret's.
const MinAdminTokenLength = MinSecretLength

// CheckConfiguredSecret refuses a secret set by configuration that is too
// weak to be a token: shorter than MinSecretLength, using fewer than
// MinSecretDistinct different characters, one short pattern repeated, or
// of less than MinSecretBits estimated entropy. The error names setting and
// the rule broken, never the value.
func CheckConfiguredSecret(setting, secret string) error {
	runes := []rune(secret)
	if len(runes) < MinSecretLength {
		return fmt.Errorf("%s must be at least %d characters", setting, MinSecretLength)
	}
	distinct := map[rune]bool{}
	for _, r := range runes {
		if !unicode.IsPrint(r) || unicode.IsSpace(r) {
			return fmt.Errorf("%s must be printable characters without spaces", setting)
		}
		distinct[r] = true
	}
	if len(distinct) < MinSecretDistinct {
		return fmt.Errorf("%s must use at least %d different characters", setting, MinSecretDistinct)
	}
	if p := period(runes); p <= len(runes)/2 {
		return fmt.Errorf("%s must not be a short pattern repeated (it repeats every %d characters)", setting, p)
	}
	if bits := estimatedBits(runes); bits < MinSecretBits {
		return fmt.Errorf("%s has too little entropy: about %d bits from its length and the kinds of character it uses, at least %d needed (use 32 random bytes, e.g. openssl rand -base64 32)",
			setting, bits, MinSecretBits)
	}
	return nil
}

// period is the smallest p such that s repeats every p characters (the
// last repetition may be cut short): len(s) when it does not repeat.
func period(s []rune) int {
	for p := 1; p < len(s); p++ {
		repeats := true
		for i := p; i < len(s); i++ {
			if s[i] != s[i-p] {
				repeats = false
				break
			}
		}
		if repeats {
			return p
		}
	}
	return len(s)
}

// estimatedBits is len(s)·log2(the size of the alphabet of the kinds of
// character s uses): an upper bound on a chosen value's entropy.
func estimatedBits(s []rune) int {
	var lower, upper, digit, other bool
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z':
			lower = true
		case r >= 'A' && r <= 'Z':
			upper = true
		case r >= '0' && r <= '9':
			digit = true
		default:
			other = true
		}
	}
	alphabet := 0
	for _, k := range []struct {
		used bool
		size int
	}{{lower, 26}, {upper, 26}, {digit, 10}, {other, 33}} {
		if k.used {
			alphabet += k.size
		}
	}
	return int(float64(len(s)) * math.Log2(float64(alphabet)))
}
