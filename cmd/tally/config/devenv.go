package config

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/tallymeter/tally/internal/embeddedpg"
)

// DevEnvFile is the file tally dev writes in its data directory while it
// runs: the settings an operator command needs to reach dev's database
// and Stripe simulator. Every command but serve and dev reads it from its
// data directory (TALLY_DATA_DIR, default .tally) when it is there; the
// environment and flags win over it (see devEnvGroups). It holds a key: it
// is written 0600, and a file of another user or one group or others may
// read is refused (ReadOwnFile), as dev's token files are.
const DevEnvFile = "dev.env"

// DevConfig says where settings came from besides the environment and the
// flags.
type DevConfig struct {
	// EnvFile is the DevEnvFile the settings were read from; empty when
	// none was.
	EnvFile string
	// From lists the variables taken from it.
	From []string
}

// devEnvGroups are the variables DevEnvFile may hold, in groups taken
// whole or not at all: a group is taken only when none of its variables
// (or their _FILE forms, or their flags) is set, so that a key from the
// environment is never sent to dev's simulator, nor dev's key to Stripe.
var devEnvGroups = [][]string{
	{"TALLY_DATABASE_URL"},
	{"STRIPE_API_KEY", "STRIPE_API_BASE", "STRIPE_METER_EVENTS_BASE", "STRIPE_ACCOUNT", "STRIPE_WEBHOOK_SECRET"},
}

// WriteDevEnv writes vars to DevEnvFile in dataDir (made 0700 if missing),
// mode 0600, replacing the file; only variables of devEnvGroups, after
// notes as comment lines (where dev keeps its admin token, say). It
// returns the file's path.
func WriteDevEnv(dataDir string, vars map[string]string, notes ...string) (string, error) {
	var b bytes.Buffer
	b.WriteString("# Written by tally dev while it runs; removed when it stops. Operator commands\n" +
		"# run with this data directory read it (the environment and flags win).\n")
	for _, n := range notes {
		if strings.ContainsAny(n, "\r\n") {
			return "", errors.New("a note holds a line break")
		}
		b.WriteString("# " + n + "\n")
	}
	for _, group := range devEnvGroups {
		for _, name := range group {
			if v, ok := vars[name]; ok {
				if strings.ContainsAny(v, "\r\n") {
					return "", fmt.Errorf("%s: a value holds a line break", name)
				}
				fmt.Fprintf(&b, "%s=%s\n", name, v)
			}
		}
	}
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return "", err
	}
	path := filepath.Join(dataDir, DevEnvFile)
	tmp, err := os.CreateTemp(dataDir, DevEnvFile+".*")
	if err != nil {
		return "", err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b.Bytes()); err != nil {
		tmp.Close()
		return "", err
	}
	if err := tmp.Close(); err != nil {
		return "", err
	}
	return path, os.Rename(tmp.Name(), path)
}

// devEnv is the variables of the DevEnvFile a command reads, and where.
type devEnv struct {
	path string
	vars map[string]string
}

// readDevEnv reads DevEnvFile from the first of dirs that has one: a zero
// devEnv when none has; an error for a file tally dev did not make
// (ReadOwnFile) or a line that is not NAME=value of devEnvGroups.
func readDevEnv(dirs []string) (devEnv, error) {
	for _, dir := range dirs {
		path := filepath.Join(dir, DevEnvFile)
		b, err := ReadOwnFile(path, "for settings")
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return devEnv{}, err
		}
		vars := map[string]string{}
		sc := bufio.NewScanner(bytes.NewReader(b))
		for n := 1; sc.Scan(); n++ {
			line := strings.TrimSpace(sc.Text())
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			name, v, ok := strings.Cut(line, "=")
			if !ok || !slices.ContainsFunc(devEnvGroups, func(g []string) bool { return slices.Contains(g, name) }) {
				return devEnv{}, fmt.Errorf("%s, line %d: not NAME=value of a variable tally dev writes; remove the file and start tally dev again", path, n)
			}
			vars[name] = v
		}
		return devEnv{path: path, vars: vars}, nil
	}
	return devEnv{}, nil
}

// devEnvDirs are where a command looks for DevEnvFile: the data directory
// chosen (flag or TALLY_DATA_DIR); else the default, and the directory it
// moves to when PostgreSQL's user cannot reach it (embeddedpg.Fallback),
// where dev keeps its cluster then.
func devEnvDirs(dataDir string, chosen bool) []string {
	if chosen || !embeddedpg.Unreachable(dataDir, "") {
		return []string{dataDir}
	}
	return []string{dataDir, embeddedpg.Fallback(dataDir)}
}

// withDevEnv returns getenv with the groups of env that the command line
// leaves unset (set reports whether a variable or its flag is), and the
// names it takes.
func withDevEnv(getenv func(string) string, env devEnv, set func(name string) bool) (func(string) string, []string) {
	taken := map[string]string{}
	var names []string
	for _, group := range devEnvGroups {
		if slices.ContainsFunc(group, set) {
			continue
		}
		for _, name := range group {
			if v, ok := env.vars[name]; ok {
				taken[name] = v
				names = append(names, name)
			}
		}
	}
	if len(taken) == 0 {
		return getenv, nil
	}
	return func(name string) string {
		if v := getenv(name); v != "" {
			return v
		}
		return taken[name]
	}, names
}

// devEnvFor is getenv with what a command takes from DevEnvFile, and where
// it came from; getenv itself when it does not read it (read false: serve,
// dev) and when no file is there. values and given are the flags of all, as Flags keeps
// them.
func devEnvFor(read bool, all []setting, values []string, given []bool, getenv func(string) string) (func(string) string, DevConfig, error) {
	if !read {
		return getenv, DevConfig{}, nil
	}
	flagged := func(name string) (string, bool) {
		i := slices.IndexFunc(all, func(s setting) bool { return s.env == name })
		if i < 0 || !given[i] {
			return "", false
		}
		return values[i], true
	}
	dataDir, chosen := flagged("TALLY_DATA_DIR")
	if !chosen {
		dataDir, chosen = getenv("TALLY_DATA_DIR"), getenv("TALLY_DATA_DIR") != ""
	}
	if !chosen {
		dataDir = DefaultDataDir
	}
	env, err := readDevEnv(devEnvDirs(dataDir, chosen))
	if err != nil || env.path == "" {
		return getenv, DevConfig{}, err
	}
	set := func(name string) bool {
		_, f := flagged(name)
		return f || getenv(name) != "" || getenv(name+"_FILE") != ""
	}
	wrapped, names := withDevEnv(getenv, env, set)
	return wrapped, DevConfig{EnvFile: env.path, From: names}, nil
}
