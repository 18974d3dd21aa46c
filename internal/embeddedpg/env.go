package embeddedpg

import (
	"os"
	"strings"
)

// childEnv is the environment of every process Start runs (initdb,
// postgres, the watchdog): the variables of tally's own that keptEnv
// allows and nothing else, so that tally's secrets (TALLY_ADMIN_TOKEN,
// STRIPE_API_KEY, STRIPE_WEBHOOK_SECRET, a database URL) never reach the
// server, where its user could read them in /proc and a database superuser
// through COPY … TO PROGRAM. HOME is that of the user the children run as.
func childEnv(as *runAs) []string {
	var env []string
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); keptEnv(name) {
			env = append(env, kv)
		}
	}
	home := os.Getenv("HOME")
	if as != nil {
		home = as.home
	}
	if home != "" {
		env = append(env, "HOME="+home)
	}
	return env
}

// keptEnv reports whether a variable of tally's environment passes to the
// children: where to find programs (PATH) and shared libraries
// (LD_LIBRARY_PATH, DYLD_LIBRARY_PATH, for a PostgreSQL installed outside
// the system's paths), the locale (LANG, LC_*) and the time zone (TZ), which
// initdb writes into the new cluster's configuration. No PG* variable
// passes: they could redirect initdb and postgres.
func keptEnv(name string) bool {
	switch name {
	case "PATH", "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH", "LANG", "TZ":
		return true
	}
	return strings.HasPrefix(name, "LC_")
}
