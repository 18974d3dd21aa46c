package config

import (
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
)

// MaxSecretFileBytes is the most a secret's file (…_FILE) may hold.
const MaxSecretFileBytes = 64 << 10

// secretSettings are the settings whose value may instead be read from a
// file named by <VAR>_FILE (a mounted secret), so that nothing sensitive
// needs a flag, which shows in the process list, or the environment.
var secretSettings = []string{"STRIPE_API_KEY", "STRIPE_WEBHOOK_SECRET", "TALLY_ADMIN_TOKEN", "TALLY_DATABASE_URL", "TALLY_DATABASE_OWNER_URL", "TALLY_DATABASE_DIRECT_URL", "TALLY_ARCHIVE_SECRET_KEY"}

// secretFromFile reads the value of the setting env from the file named by
// env_FILE, when that is set: ok reports whether it was. from says where
// the value would otherwise come from ("default" when nowhere); setting
// both is an error, as is a file that cannot be read, is empty or too
// large. Errors name the file, never its content.
func secretFromFile(getenv func(string) string, env, from string) (v string, ok bool, err error) {
	if !slices.Contains(secretSettings, env) {
		return "", false, nil
	}
	name := env + "_FILE"
	path := getenv(name)
	if path == "" {
		return "", false, nil
	}
	if from != "default" {
		return "", false, fmt.Errorf("%s and %s are both set: give the value one way (prefer the file)", from, name)
	}
	f, err := os.Open(path)
	if err != nil {
		return "", false, fmt.Errorf("%s: %w", name, err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, MaxSecretFileBytes+1))
	if err != nil {
		return "", false, fmt.Errorf("%s: %w", name, err)
	}
	if len(b) > MaxSecretFileBytes {
		return "", false, fmt.Errorf("%s: %s holds more than %d bytes", name, path, MaxSecretFileBytes)
	}
	v = strings.TrimRight(string(b), "\r\n")
	if v == "" {
		return "", false, fmt.Errorf("%s: %s is empty", name, path)
	}
	return v, true, nil
}
