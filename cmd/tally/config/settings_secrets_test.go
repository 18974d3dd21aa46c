package config_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// secretFile writes content into a file of its own and returns its path.
func secretFile(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "secret")
	require.NoError(t, os.WriteFile(path, []byte(content), 0o600))
	return path
}

func TestSecretFromFileProblems(t *testing.T) {
	t.Parallel()
	const token = "tly_adm_0123456789abcdef0123456789abcdef"
	unreadable := secretFile(t, token)
	require.NoError(t, os.Chmod(unreadable, 0))
	missing := filepath.Join(t.TempDir(), "absent")
	for _, tc := range []struct {
		name    string
		env     map[string]string
		args    []string
		wantErr string
	}{
		{"the variable and the file", map[string]string{"TALLY_ADMIN_TOKEN": token, "TALLY_ADMIN_TOKEN_FILE": secretFile(t, token)}, nil,
			"TALLY_ADMIN_TOKEN and TALLY_ADMIN_TOKEN_FILE are both set"},
		{"the flag and the file", map[string]string{"TALLY_DATABASE_URL_FILE": secretFile(t, "postgres://u:pw@db/tally")},
			[]string{"--database-url", "postgres://u:pw@db/tally"}, "--database-url and TALLY_DATABASE_URL_FILE are both set"},
		{"a missing file", map[string]string{"STRIPE_API_KEY_FILE": missing}, nil, "STRIPE_API_KEY_FILE: open " + missing},
		{"an empty file", map[string]string{"STRIPE_WEBHOOK_SECRET_FILE": secretFile(t, "\n")}, nil, "is empty"},
		{"a directory", map[string]string{"STRIPE_API_KEY_FILE": t.TempDir()}, nil, "STRIPE_API_KEY_FILE: read "},
		{"a file too large", map[string]string{"STRIPE_API_KEY_FILE": secretFile(t, strings.Repeat("k", 70<<10))}, nil, "holds more than 65536 bytes"},
	} {
		_, err := load(t, tc.env, tc.args...)
		require.ErrorContains(t, err, tc.wantErr, tc.name)
		require.NotContains(t, err.Error(), "0123456789abcdef", "%s: never the content", tc.name)
		require.NotContains(t, err.Error(), ":pw@", "%s: never the content", tc.name)
	}
	if os.Geteuid() != 0 { // root reads any file
		_, err := load(t, map[string]string{"TALLY_ADMIN_TOKEN_FILE": unreadable})
		require.ErrorContains(t, err, "TALLY_ADMIN_TOKEN_FILE: open "+unreadable+": permission denied")
		require.NotContains(t, err.Error(), token)
	}
}

// Each secret setting reads its value from <VAR>_FILE, without the
// trailing newline an editor or `echo` leaves; the value is then checked
// like one from the variable.
func TestSecretsReadFromFiles(t *testing.T) {
	t.Parallel()
	const token = "tly_adm_0123456789abcdef0123456789abcdef"
	c, err := load(t, map[string]string{
		"STRIPE_API_KEY_FILE":        secretFile(t, "sk_test_fromfile\n"),
		"STRIPE_WEBHOOK_SECRET_FILE": secretFile(t, "whsec_fromfile\r\n"),
		"TALLY_ADMIN_TOKEN_FILE":     secretFile(t, token),
		"TALLY_DATABASE_URL_FILE":    secretFile(t, "postgres://tally:pw@db:5432/tally\n\n"),
	})
	require.NoError(t, err)
	require.Equal(t, "sk_test_fromfile", c.StripeAPIKey)
	require.Equal(t, "whsec_fromfile", c.StripeWebhookSecret)
	require.Equal(t, token, c.AdminToken)
	require.Equal(t, "postgres://tally:pw@db:5432/tally", c.DatabaseURL)

	_, err = load(t, map[string]string{"STRIPE_WEBHOOK_SECRET_FILE": secretFile(t, "not-a-secret\n")})
	require.ErrorContains(t, err, "STRIPE_WEBHOOK_SECRET must be the signing secrets of the event destinations")

	// Only the secret settings read files.
	c, err = load(t, map[string]string{"TALLY_LISTEN_FILE": secretFile(t, "0.0.0.0:1\n")})
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1:8080", c.Listen)
}
