package commentcheck

import (
	"fmt"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// rule is one kind of lab note a comment of non-test code must not hold.
type rule struct {
	name string
	re   *regexp.Regexp
}

var rules = []rule{
	{"issue number", regexp.MustCompile(`(?i)\bissue #?[0-9]+`)},
	{"section sign", regexp.MustCompile(`§`)},
	{"found it", regexp.MustCompile(`(?i)\bfound (it|by)\b`)},
	{"measured", regexp.MustCompile(`(?i)\bmeasured\b`)},
	{"migration number", regexp.MustCompile(`(?i)\bmigrations? [0-9]+`)},
	{"transition number", regexp.MustCompile(`\bT[0-9]+[a-z]?\b`)},
}

// allowed are the paths, relative to the module's root, whose comments may
// hold history: the migrations are that history.
var allowed = []string{"migrations/"}

// TestCommentsHoldNoLabNotes reads the comments of every non-test Go file
// of the module and fails on each line that breaks a rule.
func TestCommentsHoldNoLabNotes(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	require.NoError(t, err)
	var found []string
	fset := token.NewFileSet()
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			if rel != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || skipped(rel+"/")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(rel, ".go") || strings.HasSuffix(rel, "_test.go") || skipped(rel) {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments|parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		for _, group := range f.Comments {
			for _, c := range group.List {
				for i, line := range strings.Split(c.Text, "\n") {
					for _, r := range rules {
						if r.re.MatchString(line) {
							found = append(found, fmt.Sprintf("%s:%d: %s: %s", rel, fset.Position(c.Pos()).Line+i, r.name, strings.TrimSpace(line)))
						}
					}
				}
			}
		}
		return nil
	})
	require.NoError(t, err)
	require.Empty(t, found, "comments of non-test code say what and why; numbers, sections, timings and test stories go in commit messages and docs")
}

// TestRulesCatchLabNotes holds each rule to a line it must catch and one it
// must let through.
func TestRulesCatchLabNotes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ rule, caught, passed string }{
		{"issue number", "cancellations (issue 19, part 2)", "an issue of the report"},
		{"section sign", "(docs/stripe.md §9)", "(docs/stripe.md)"},
		{"found it", "(TestCancelAdjustmentsSurviveKills found it)", "found, it returns"},
		{"measured", "14% of an accept, measured", "a measure of the backlog"},
		{"migration number", "the CHECK of migration 26", "the migrations set it"},
		{"transition number", "Accept is T2; requeue (T9r)", "2026-12-05T23:00:00Z, a TLS key"},
	} {
		i := slices.IndexFunc(rules, func(r rule) bool { return r.name == tc.rule })
		require.NotEqual(t, -1, i, tc.rule)
		require.True(t, rules[i].re.MatchString(tc.caught), "%s should catch %q", tc.rule, tc.caught)
		require.False(t, rules[i].re.MatchString(tc.passed), "%s should pass %q", tc.rule, tc.passed)
	}
}

// skipped reports whether rel (a file, or a directory ending in a slash) is
// allowed history or awaits another branch's clean-up.
func skipped(rel string) bool {
	for _, p := range allowed {
		if strings.HasPrefix(rel, p) {
			return true
		}
	}
	return false
}
