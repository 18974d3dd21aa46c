package auth_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
)

// A configured secret a person chose is refused when short, made of few
// characters, a word repeated or of little entropy; the error names the
// setting and the rule, never the value.
func TestWeakConfiguredSecretsRefused(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ value, rule string }{
		{"", "at least 32 characters"},
		{"adminadminadminadminadmin", "at least 32 characters"}, // the 24-character kind once accepted
		{strings.Repeat("a", 40), "at least 10 different characters"},
		{strings.Repeat("admin", 8), "at least 10 different characters"},
		{strings.Repeat("Passw0rd-42!", 3), "short pattern repeated (it repeats every 12 characters)"},
		{strings.Repeat("abcdefghijkl", 3)[:33], "short pattern repeated (it repeats every 12 characters)"},
		{"31415926535897932384626433832795028", "too little entropy: about 116 bits"}, // digits only
		{"correct horse battery staple and more", "printable characters without spaces"},
		{"tab\tinside-0123456789abcdefghijklmnop", "printable characters without spaces"},
	} {
		err := auth.CheckConfiguredSecret("TALLY_ADMIN_TOKEN", c.value)
		require.Error(t, err, "%q", c.value)
		require.Contains(t, err.Error(), "TALLY_ADMIN_TOKEN ")
		require.Contains(t, err.Error(), c.rule, "%q", c.value)
		if c.value != "" {
			require.NotContains(t, err.Error(), c.value[:8], "the error never shows the value")
		}
	}
	for _, strong := range []string{
		"an-admin-token-of-enough-length-0123456789",
		"e2e-admin-token-0123456789abcdef",
		"3f9a1c7e5b2d4086af13c9e7b5d20f4a",                               // openssl rand -hex 16
		"q3S0y8m1Zr6WcB7xQmXz+0f9Kp2LdA4vN5tYhGjE1uI=",                   // openssl rand -base64 32
		auth.TokenPrefix + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789_-AbCdE", // a token Tally made
	} {
		require.NoError(t, auth.CheckConfiguredSecret("TALLY_ADMIN_TOKEN", strong), strong)
	}
}
