package config

import (
	"fmt"
	"time"

	"github.com/tallymeter/tally/console"
)

// ConsoleConfig is the web console's sessions.
type ConsoleConfig struct {
	// SessionTTL is how long a console session lasts at most, however much
	// it is used. Defaults to console.DefaultSessionTTL.
	SessionTTL time.Duration
	// SessionIdle is how long a console session lasts unused. Defaults to
	// console.DefaultSessionIdle.
	SessionIdle time.Duration
}

// consoleSettings say how long a console session lasts: at most, and
// unused.
func consoleSettings() []setting {
	return []setting{
		{"TALLY_CONSOLE_SESSION_TTL", "console-session-ttl", "how long a console session lasts at most, however much it is used", short(console.DefaultSessionTTL),
			dur(func(c *Config) *time.Duration { return &c.Console.SessionTTL })},
		{"TALLY_CONSOLE_SESSION_IDLE", "console-session-idle", "how long a console session lasts unused", short(console.DefaultSessionIdle),
			dur(func(c *Config) *time.Duration { return &c.Console.SessionIdle })},
	}
}

// consoleProblems are those of the console's sessions.
func (c *Config) consoleProblems() []error {
	var errs []error
	if c.Console.SessionTTL <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_CONSOLE_SESSION_TTL must be positive, got %s", c.Console.SessionTTL))
	}
	if c.Console.SessionIdle <= 0 {
		errs = append(errs, fmt.Errorf("TALLY_CONSOLE_SESSION_IDLE must be positive, got %s", c.Console.SessionIdle))
	}
	if c.Console.SessionTTL > 0 && c.Console.SessionIdle > c.Console.SessionTTL {
		errs = append(errs, fmt.Errorf("TALLY_CONSOLE_SESSION_IDLE (%s) must not exceed TALLY_CONSOLE_SESSION_TTL (%s)",
			c.Console.SessionIdle, c.Console.SessionTTL))
	}
	return errs
}
