package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/embeddedpg"
)

// syncBuffer is a bytes.Buffer safe to read while a process writes to it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestDev is the README's first command as a newcomer runs it: `tally dev`
// in a checkout with no settings — as root in CI, from a checkout under a
// 0700 directory as /root is — serves the API and the simulator, prints a
// curl line, and the usage that line posts reaches the simulator: the count
// feature at once, the sum feature when its minute window closes.
func TestDev(t *testing.T) {
	t.Parallel()
	home, err := os.MkdirTemp("", "tally-home-")
	require.NoError(t, err)
	require.NoError(t, os.Chmod(home, 0o700))
	checkout := filepath.Join(home, "tally")
	require.NoError(t, os.Mkdir(checkout, 0o755))
	t.Cleanup(func() {
		_ = os.RemoveAll(home)
		_ = os.RemoveAll(embeddedpg.Fallback(filepath.Join(checkout, ".tally")))
	})

	addr, simAddr := freeAddr(t), freeAddr(t)
	var out syncBuffer
	cmd := exec.Command(binary, "dev", "--sim-listen", simAddr)
	cmd.Dir = checkout
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "TALLY_") && !strings.HasPrefix(kv, "STRIPE_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "TALLY_LISTEN="+addr)
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	require.Eventually(t, func() bool { return strings.Contains(out.String(), "Stop with Ctrl-C") },
		60*time.Second, 100*time.Millisecond, "dev did not start")
	if os.Geteuid() == 0 {
		require.Contains(t, out.String(), "using="+embeddedpg.Fallback(filepath.Join(checkout, ".tally")),
			"as root, the unreachable default data directory moves, and says so")
	}
	code, body := get("http://" + addr + "/readyz")
	require.Equal(t, http.StatusOK, code, body)
	require.JSONEq(t, `{"status":"ready","checks":{"database":"ok","schema":"ok","export":"ok"}}`, body)

	// The curl line, run as printed.
	printed := out.String()
	start := strings.Index(printed, "Post usage:\n")
	end := strings.Index(printed, "See it reach Stripe")
	require.True(t, start >= 0 && end > start, "no curl line in:\n%s", printed)
	curl := printed[start+len("Post usage:\n") : end]
	res, err := exec.Command("bash", "-c", curl).CombinedOutput()
	require.NoError(t, err, "%s", res)
	require.JSONEq(t, `{"accepted":2,"duplicates":0}`, string(res))

	landed := func(feature string) bool {
		code, body := get("http://" + simAddr + "/_sim/events")
		if code != http.StatusOK {
			return false
		}
		var got struct {
			Events []struct {
				EventName string `json:"event_name"`
				Customer  string `json:"customer"`
				Status    string `json:"status"`
			}
		}
		if json.Unmarshal([]byte(body), &got) != nil {
			return false
		}
		for _, e := range got.Events {
			if e.EventName == feature && e.Customer == "cus_acme" && e.Status == "recorded" {
				return true
			}
		}
		return false
	}
	require.Eventually(t, func() bool { return landed("logins") }, 30*time.Second, 200*time.Millisecond,
		"the count event did not reach the simulator:\n%s", &out)
	require.Eventually(t, func() bool { return landed("api_calls") }, 90*time.Second, 500*time.Millisecond,
		"the sum window did not reach the simulator within its minute:\n%s", &out)

	// As the README says: a reconcile run with no settle delay confirms
	// what reached the simulator.
	var admin string
	for _, line := range strings.Split(printed, "\n") {
		if v, ok := strings.CutPrefix(line, "Admin token:"); ok {
			admin = strings.TrimSpace(v)
		}
	}
	require.NotEmpty(t, admin, printed)
	code, body = post(t, http.MethodPost, "http://"+addr+"/v1/reconcile/runs", admin, map[string]string{"settle": "0s"})
	require.Equal(t, http.StatusAccepted, code, body)
	var run struct {
		ID             int64  `json:"id"`
		Status         string `json:"status"`
		ItemsConfirmed int64  `json:"items_confirmed"`
		Discrepancies  int    `json:"discrepancies"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &run))
	require.Eventually(t, func() bool {
		code, body := post(t, http.MethodGet, fmt.Sprintf("http://%s/v1/reconcile/runs/%d", addr, run.ID), admin, nil)
		require.Equal(t, http.StatusOK, code, body)
		require.NoError(t, json.Unmarshal([]byte(body), &run))
		return run.Status == "succeeded" || run.Status == "failed"
	}, 30*time.Second, 100*time.Millisecond)
	require.Equal(t, "succeeded", run.Status)
	require.Equal(t, int64(2), run.ItemsConfirmed, "the logins event and the api_calls window")
	require.Zero(t, run.Discrepancies)

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	require.NoError(t, cmd.Wait(), "%s", &out)
	require.NotContains(t, out.String(), "level=ERROR")
}
