package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// peakRSS reads a process's high-water resident set size (VmHWM), in MiB.
func peakRSS(pid int) (float64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 64)
			return kb / 1024, err
		}
	}
	return 0, fmt.Errorf("no VmHWM in /proc/%d/status", pid)
}

// BenchmarkNodeMemory measures the peak resident memory of a `tally serve`
// process under load — 50,000 usage events posted in batches of 1,000
// across 100 tenants and three features, staged and exported to the
// simulator until drained — beside the same process's peak after start-up
// and idle, measured in the same run.
//
//	go test ./cmd/tally -run '^$' -bench NodeMemory -benchtime 1x
func BenchmarkNodeMemory(b *testing.B) {
	const (
		events  = 50_000
		tenants = 100
		admin   = "bench-admin-token-0123456789abcdef"
	)
	sim := stripesim.New(stripesim.Options{Seed: 5})
	srv := httptest.NewServer(sim.Handler())
	b.Cleanup(func() { sim.Close(); srv.Close() })
	features := []struct{ name, formula string }{{"api_calls", "sum"}, {"seats", "last"}, {"logins", "count"}}
	for _, f := range features {
		sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{DisplayName: f.name, EventName: f.name, Formula: f.formula})
	}
	for i := 0; i < tenants; i++ {
		sim.CreateCustomer(stripesim.DefaultAccount, fmt.Sprintf("cus_m%03d", i))
	}
	url := testdb.URL(b)
	n := &node{t: b, addr: freeAddrB(b)}
	n.env = []string{"TALLY_DATABASE_URL=" + url, "TALLY_LISTEN=" + n.addr, "TALLY_ADMIN_TOKEN=" + admin,
		"STRIPE_API_KEY=" + stripesim.DefaultKey, "STRIPE_API_BASE=" + srv.URL, "TALLY_STAGE_INTERVAL=500ms",
		"TALLY_WINDOW_GRACE=1s", "TALLY_RATE_TEST=2000", "TALLY_BASIC_RATE_TEST=4000", "TALLY_LOG_LEVEL=error"}
	n.start()
	defer n.stop()
	base := "http://" + n.addr
	for _, f := range features {
		if code, body := postB(b, http.MethodPut, base+"/v1/mappings/features/"+f.name, admin, map[string]string{"event_name": f.name, "aggregation": f.formula}); code != 200 {
			b.Fatal(body)
		}
	}
	for i := 0; i < tenants; i++ {
		if code, body := postB(b, http.MethodPut, fmt.Sprintf("%s/v1/mappings/tenants/m%03d", base, i), admin,
			map[string]string{"stripe_customer_id": fmt.Sprintf("cus_m%03d", i)}); code != 200 {
			b.Fatal(body)
		}
	}
	time.Sleep(2 * time.Second)
	idle, err := peakRSS(n.cmd.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}

	b.ResetTimer()
	start := time.Now()
	now := time.Now().UTC().Truncate(time.Hour)
	for i := 0; i < events; i += 1000 {
		batch := make([]e2eEvent, 0, 1000)
		for k := i; k < i+1000; k++ {
			f := features[k%3].name
			batch = append(batch, e2eEvent{ID: fmt.Sprintf("m%06d", k), Tenant: fmt.Sprintf("m%03d", (k/3)%tenants), Feature: f,
				Value: 1, Timestamp: now.Add(-time.Duration(1+k%7200) * time.Second).Format(time.RFC3339)})
		}
		if code, body := postB(b, http.MethodPost, base+"/v1/usage", admin, map[string]any{"events": batch}); code != http.StatusAccepted {
			b.Fatal(body)
		}
	}
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	for deadline := time.Now().Add(10 * time.Minute); ; time.Sleep(500 * time.Millisecond) {
		unstaged, open, err := openWork(context.Background(), pool)
		if err == nil && open == 0 && unstaged == 0 {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("not drained: %d open, %d unstaged", open, unstaged)
		}
	}
	elapsed := time.Since(start)
	loaded, err := peakRSS(n.cmd.Process.Pid)
	if err != nil {
		b.Fatal(err)
	}
	var items int
	_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_items`).Scan(&items)
	fmt.Printf("\ntally serve: %d events posted (batches of 1,000), %d items staged and exported to the simulator in %s\n",
		events, items, elapsed.Round(time.Second))
	fmt.Printf("%-36s %10s\n", "", "peak RSS")
	fmt.Printf("%-36s %8.1f MiB\n", "after start-up, idle (baseline)", idle)
	fmt.Printf("%-36s %8.1f MiB   %.2fx\n\n", "under load, until drained", loaded, loaded/idle)
	b.ReportMetric(idle, "idle_MiB")
	b.ReportMetric(loaded, "loaded_MiB")
}

func freeAddrB(b *testing.B) string {
	b.Helper()
	l, err := netListen()
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func postB(b *testing.B, method, url, token string, body any) (int, string) {
	b.Helper()
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		code, out := postOnceMethod(method, url, token, body)
		if code != 0 && code < 500 {
			return code, out
		}
		if time.Now().After(deadline) {
			b.Fatalf("no answer from %s", url)
		}
	}
}

func netListen() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") }

// postOnceMethod sends one JSON request and reports the status and body
// (0: no answer).
func postOnceMethod(method, url, token string, body any) (int, string) {
	b, _ := json.Marshal(body)
	req, err := http.NewRequest(method, url, bytes.NewReader(b))
	if err != nil {
		return 0, err.Error()
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(out)
}
