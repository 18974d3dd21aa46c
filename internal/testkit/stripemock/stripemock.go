// Package stripemock runs Stripe's stripe-mock for contract tests: the
// request shapes Tally sends are checked against Stripe's own OpenAPI
// specification, which stripe-mock validates every request against.
//
// What it owns: building stripe-mock at [Version] once (with go install,
// into the user's cache directory) and running one instance per test on a
// loopback port chosen by the system, behind a proxy that records what was
// sent. What it must never do: stand in for the simulator — stripe-mock is
// stateless and answers fixtures; behaviour is tested against
// internal/stripesim.
package stripemock

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// Version is the stripe-mock release the contract tests run.
const Version = "v0.203.0"

// Module is stripe-mock's Go module path.
const Module = "github.com/stripe/stripe-mock"

// EnvBinary names an environment variable that, when set, is the path of a
// stripe-mock binary to use instead of building one.
const EnvBinary = "TALLY_STRIPE_MOCK"

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// Binary returns the path of a stripe-mock binary at Version: $TALLY_STRIPE_MOCK
// when set, else one built by `go install` into the user's cache directory
// (once; later runs reuse it).
func Binary() (string, error) {
	buildOnce.Do(func() { binPath, buildErr = build() })
	return binPath, buildErr
}

func build() (string, error) {
	if p := os.Getenv(EnvBinary); p != "" {
		return p, nil
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("stripemock: no cache directory for stripe-mock: %w (or set %s)", err, EnvBinary)
	}
	dir := filepath.Join(cache, "tally", "stripe-mock-"+Version)
	bin := filepath.Join(dir, "stripe-mock")
	if _, err := os.Stat(bin); err == nil {
		return bin, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("stripemock: %w", err)
	}
	// Install into a directory of our own and rename, so that test
	// processes building at once never see half a binary.
	tmp, err := os.MkdirTemp(dir, "build-")
	if err != nil {
		return "", fmt.Errorf("stripemock: %w", err)
	}
	defer os.RemoveAll(tmp)
	cmd := exec.Command("go", "install", Module+"@"+Version)
	cmd.Env = append(os.Environ(), "GOBIN="+tmp, "GOFLAGS=")
	cmd.Dir = tmp // outside any module
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("stripemock: go install %s@%s: %w\n%s", Module, Version, err, out)
	}
	if err := os.Rename(filepath.Join(tmp, "stripe-mock"), bin); err != nil {
		return "", fmt.Errorf("stripemock: %w", err)
	}
	return bin, nil
}

// Request is one request as it reached stripe-mock.
type Request struct {
	Method string
	Path   string
	Query  url.Values
	Header http.Header
	Form   url.Values
	// Status is stripe-mock's answer: 2xx when the request matches Stripe's
	// specification.
	Status int
	// Body is stripe-mock's response body.
	Body string
}

// Mock is one running stripe-mock behind a recording proxy.
type Mock struct {
	// URL is the base URL to give stripe-go.
	URL string

	mu       sync.Mutex
	requests []Request
}

// Requests returns what was sent so far, in order.
func (m *Mock) Requests() []Request {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]Request(nil), m.requests...)
}

type formKey struct{}

var listening = regexp.MustCompile(`Listening for HTTP at address: (\S+)`)

// Start runs stripe-mock for the test and stops it at cleanup. A stripe-mock
// that cannot be built or started fails the test: contract tests never skip.
func Start(t testing.TB) *Mock {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Fatal(err)
	}
	target := launch(t, bin)
	m := &Mock{}
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.ModifyResponse = m.record
	srv := httptest.NewServer(keepForm(proxy))
	t.Cleanup(srv.Close)
	m.URL = srv.URL
	return m
}

// launch starts stripe-mock at bin, stopped at the test's cleanup, and
// returns the base URL of its HTTP listener.
func launch(t testing.TB, bin string) *url.URL {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	// Both listeners on ports the system chooses: without -https-addr,
	// stripe-mock also takes the fixed port 12112 and a second instance
	// exits.
	cmd := exec.CommandContext(ctx, bin, "-http-addr", "127.0.0.1:", "-https-addr", "127.0.0.1:")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		cancel()
		t.Fatalf("stripemock: starting %s: %v", bin, err)
	}
	t.Cleanup(func() { cancel(); _ = cmd.Wait() })
	return awaitListening(t, stdout)
}

// awaitListening reads stripe-mock's output until it prints the address the
// system chose, and returns that address as a base URL; anything printed
// before it is kept for the failure message.
func awaitListening(t testing.TB, stdout io.Reader) *url.URL {
	t.Helper()
	type started struct{ addr, out string }
	ready := make(chan started, 1)
	go func() {
		var seen strings.Builder
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := listening.FindStringSubmatch(sc.Text()); m != nil {
				ready <- started{addr: m[1]}
				_, _ = io.Copy(io.Discard, stdout)
				return
			}
			seen.WriteString(sc.Text() + "\n")
		}
		ready <- started{out: seen.String()}
	}()
	var target *url.URL
	select {
	case s := <-ready:
		if s.addr == "" {
			t.Fatalf("stripemock: stripe-mock exited before listening:\n%s", s.out)
		}
		var err error
		target, err = url.Parse("http://" + s.addr)
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("stripemock: stripe-mock did not start listening within 30s")
	}
	return target
}

// record is the proxy's ModifyResponse: it keeps the request, the form
// keepForm parsed from it, and stripe-mock's answer.
func (m *Mock) record(resp *http.Response) error {
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	req := resp.Request
	form, _ := req.Context().Value(formKey{}).(url.Values)
	m.mu.Lock()
	m.requests = append(m.requests, Request{Method: req.Method, Path: req.URL.Path, Query: req.URL.Query(),
		Header: req.Header.Clone(), Form: form, Status: resp.StatusCode, Body: string(body)})
	m.mu.Unlock()
	return nil
}

// keepForm reads each request's body, parses a form body into the
// request's context (under formKey) for record, and passes the request on
// to next with its body intact. A form that does not parse is answered 400.
func keepForm(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		if strings.HasPrefix(r.Header.Get("Content-Type"), "application/x-www-form-urlencoded") {
			form, err := url.ParseQuery(string(body))
			if err != nil {
				http.Error(w, "stripemock: the form does not parse: "+err.Error(), http.StatusBadRequest)
				return
			}
			r = r.WithContext(context.WithValue(r.Context(), formKey{}, form))
		}
		next.ServeHTTP(w, r)
	})
}
