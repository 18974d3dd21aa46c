package config

import (
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/tallymeter/tally/meter"
)

// groupCommitSettings are how concurrent small POST /v1/usage batches share
// transactions (meter.GroupCommit).
func groupCommitSettings() []setting {
	return []setting{
		{"TALLY_INGEST_GROUP_COMMIT_WAIT", "ingest-group-commit-wait", "the most a small POST /v1/usage waits, once a commit slot is free, for as many others as recent shared transactions held, and never longer than a recent commit; 0: no wait",
			time.Duration(meter.DefaultGroupCommitWait).String(), dur(func(c *Config) *time.Duration { return &c.GroupCommit.Wait })},
		{"TALLY_INGEST_GROUP_COMMIT_EVENTS", "ingest-group-commit-events", "the most events concurrent POST /v1/usage requests share a transaction with; a request with more than half as many has its own; 0: none shared",
			strconv.Itoa(meter.DefaultGroupCommitEvents), integer(func(c *Config) *int { return &c.GroupCommit.MaxEvents })},
		{"TALLY_INGEST_GROUP_COMMIT_BYTES", "ingest-group-commit-bytes", "the most bytes of events (ids, tenants, features, 32 for the rest) one shared ingest transaction holds",
			strconv.Itoa(meter.DefaultGroupCommitBytes), integer(func(c *Config) *int { return &c.GroupCommit.MaxBytes })},
		{"TALLY_INGEST_GROUP_COMMIT_COMMITS", "ingest-group-commit-commits", "how many shared ingest transactions are written at once",
			strconv.Itoa(meter.DefaultGroupCommitCommits), integer(func(c *Config) *int { return &c.GroupCommit.Commits })},
	}
}

// renamedSetting is a setting's old name, still read: its variable and
// flag before the rename, and the variable it was renamed to.
type renamedSetting struct{ env, flag, to string }

// renamedSettings are the old names of renamed settings. A value under an
// old name is used when the new name is not set, and the command logs a
// warning naming both (Config.OldNames).
var renamedSettings = []renamedSetting{
	{"TALLY_INGEST_COALESCE_WAIT", "ingest-coalesce-wait", "TALLY_INGEST_GROUP_COMMIT_WAIT"},
	{"TALLY_INGEST_COALESCE_EVENTS", "ingest-coalesce-events", "TALLY_INGEST_GROUP_COMMIT_EVENTS"},
	{"TALLY_INGEST_COALESCE_BYTES", "ingest-coalesce-bytes", "TALLY_INGEST_GROUP_COMMIT_BYTES"},
	{"TALLY_INGEST_COALESCE_COMMITS", "ingest-coalesce-commits", "TALLY_INGEST_GROUP_COMMIT_COMMITS"},
}

// oldNameSettings are the settings under their old names, without a
// default, each setting what its new name sets.
func oldNameSettings(current []setting) []setting {
	out := make([]setting, 0, len(renamedSettings))
	for _, r := range renamedSettings {
		i := slices.IndexFunc(current, func(s setting) bool { return s.env == r.to })
		out = append(out, setting{r.env, r.flag, "deprecated: the old name of " + r.to, "", current[i].set})
	}
	return out
}

// groupCommitProblems are those of the group commit settings.
func (c *Config) groupCommitProblems() []error {
	var errs []error
	k := c.GroupCommit
	if k.Wait < 0 || k.Wait > time.Second {
		errs = append(errs, fmt.Errorf("TALLY_INGEST_GROUP_COMMIT_WAIT must be 0 to 1s, got %s", k.Wait))
	}
	if k.MaxEvents < 0 || k.MaxEvents > meter.MaxEvents {
		errs = append(errs, fmt.Errorf("TALLY_INGEST_GROUP_COMMIT_EVENTS must be 0 to %d, got %d", meter.MaxEvents, k.MaxEvents))
	}
	if k.MaxBytes < 1 {
		errs = append(errs, fmt.Errorf("TALLY_INGEST_GROUP_COMMIT_BYTES must be positive, got %d", k.MaxBytes))
	}
	if k.Commits < 1 {
		errs = append(errs, fmt.Errorf("TALLY_INGEST_GROUP_COMMIT_COMMITS must be at least 1, got %d", k.Commits))
	}
	return errs
}
