package config_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/cmd/tally/config"
)

// A session length that is not positive, or an idle timeout longer than
// the session may last, is refused with the other problems.
func TestConsoleSessionProblems(t *testing.T) {
	t.Parallel()
	_, err := load(t, map[string]string{"TALLY_CONSOLE_SESSION_TTL": "0s", "TALLY_CONSOLE_SESSION_IDLE": "-1m"})
	require.ErrorContains(t, err, "TALLY_CONSOLE_SESSION_TTL must be positive, got 0s")
	require.ErrorContains(t, err, "TALLY_CONSOLE_SESSION_IDLE must be positive, got -1m0s")

	_, err = load(t, map[string]string{"TALLY_CONSOLE_SESSION_TTL": "1h"}, "--console-session-idle", "2h")
	require.ErrorContains(t, err, "TALLY_CONSOLE_SESSION_IDLE (2h0m0s) must not exceed TALLY_CONSOLE_SESSION_TTL (1h0m0s)")

	_, err = load(t, map[string]string{"TALLY_CONSOLE_SESSION_IDLE": "soon"})
	require.ErrorContains(t, err, "TALLY_CONSOLE_SESSION_IDLE: not a duration")

	c, err := load(t, map[string]string{"TALLY_CONSOLE_SESSION_TTL": "12h"}, "--console-session-idle", "15m")
	require.NoError(t, err)
	require.Equal(t, config.ConsoleConfig{SessionTTL: 12 * time.Hour, SessionIdle: 15 * time.Minute}, c.Console)
}
