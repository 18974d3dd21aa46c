// Package deploy_test checks the deployment files: the Prometheus alerts
// are valid, tested, documented, and name only metrics Tally exports.
package deploy_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

type ruleFile struct {
	Groups []struct {
		Rules []struct {
			Alert string `yaml:"alert"`
			Expr  string `yaml:"expr"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// Every alert has a section in docs/operations.md, and every metric an
// alert reads is one Tally defines.
func TestAlertsAreDocumentedAndReadRealMetrics(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("prometheus/alerts.yml")
	require.NoError(t, err)
	var rf ruleFile
	require.NoError(t, yaml.Unmarshal(b, &rf))
	docs, err := os.ReadFile("../docs/operations.md")
	require.NoError(t, err)
	defined := definedMetrics(t)
	metricRE := regexp.MustCompile(`tally_[a-z_]+`)
	n := 0
	for _, g := range rf.Groups {
		for _, r := range g.Rules {
			n++
			require.Contains(t, string(docs), "\n## "+r.Alert+"\n", "%s is not described in docs/operations.md", r.Alert)
			for _, m := range metricRE.FindAllString(r.Expr, -1) {
				require.True(t, defined[m], "%s reads %s, which Tally does not export", r.Alert, m)
			}
		}
	}
	require.GreaterOrEqual(t, n, 8)
}

// definedMetrics collects the metric names the Go code declares.
func definedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	nameRE := regexp.MustCompile(`(?:Name:\s*|NewDesc\()"(tally_[a-z_]+)"`)
	out := map[string]bool{}
	err := filepath.WalkDir("..", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == ".tally") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range nameRE.FindAllStringSubmatch(string(b), -1) {
			out[m[1]] = true
		}
		return nil
	})
	require.NoError(t, err)
	require.NotEmpty(t, out)
	return out
}

// promtool checks the rules and runs their unit tests (alerts_test.yml).
// .ci/run installs it (Debian's prometheus package); elsewhere the test is
// skipped when it is not on PATH.
func TestAlertsWithPromtool(t *testing.T) {
	t.Parallel()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		if os.Getenv("TALLY_REQUIRE_PROMTOOL") != "" {
			t.Fatal("promtool is required (TALLY_REQUIRE_PROMTOOL) but not on PATH: apt-get install prometheus")
		}
		t.Skip("promtool not on PATH (apt-get install prometheus); .ci/run installs it")
	}
	for _, args := range [][]string{{"check", "rules", "alerts.yml"}, {"test", "rules", "alerts_test.yml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = "prometheus"
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
	}
}
