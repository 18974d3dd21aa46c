package main

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"sync"
	"testing"

	"github.com/tallymeter/tally/api/openapitest"
)

// The end-to-end tests' check of the OpenAPI document: every exchange the
// harness makes with a node's /v1 (post, postOnce, and any client given
// openAPITransport) is checked against api/openapi.json with
// openapitest.Checker.Check.

// nodeTests maps a node's address to the test that started it (node.start),
// so that an exchange made without a test at hand (postOnce, a client's
// own goroutines) fails the right one.
var nodeTests sync.Map // string → testing.TB

// openAPITransport is an http.RoundTripper that checks every exchange with
// /v1 against the OpenAPI document: the answer always, the request when
// the server took it. A mismatch fails t, or when t is nil the test of the
// node that answered (nodeTests); an exchange with no such node panics, as
// nothing else would report it. It reads each answer's body whole before
// handing it on (an answer cut short is handed on as cut, unchecked), and
// is safe for concurrent use.
type openAPITransport struct {
	t    testing.TB
	base http.RoundTripper // nil: http.DefaultTransport
}

func (o openAPITransport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := o.base
	if base == nil {
		base = http.DefaultTransport
	}
	var sent []byte
	if req.Body != nil && req.Body != http.NoBody {
		var err error
		sent, err = io.ReadAll(req.Body)
		_ = req.Body.Close()
		if err != nil {
			return nil, err
		}
		req = req.Clone(req.Context())
		req.Body = io.NopCloser(bytes.NewReader(sent))
		req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(sent)), nil }
	}
	resp, err := base.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if err != nil {
		// The answer was cut (the node was killed, say): nothing whole to
		// check; the caller reads what came and then the error.
		resp.Body = io.NopCloser(io.MultiReader(bytes.NewReader(body), errReader{err}))
		return resp, nil
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	if err := o.check(req, sent, resp, body); err != nil {
		o.fail(req.URL.Host, err)
	}
	return resp, nil
}

func (o openAPITransport) check(req *http.Request, sent []byte, resp *http.Response, body []byte) error {
	c, err := openapitest.Default()
	if err != nil {
		return fmt.Errorf("reading the OpenAPI document: %w", err)
	}
	return c.Check(req, sent, resp, body)
}

// fail reports err to o.t, else to the test of the node at host.
func (o openAPITransport) fail(host string, err error) {
	t := o.t
	if t == nil {
		if v, ok := nodeTests.Load(host); ok {
			t = v.(testing.TB)
		}
	}
	if t == nil {
		panic(fmt.Sprintf("an exchange with %s, which no node of this test started, does not match the OpenAPI document: %v", host, err))
	}
	t.Errorf("%v", err)
}

// errReader fails every read with its error.
type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// TestOpenAPITransportFailsOnAMismatch: the transport the harness checks
// with reports an answer the document does not describe, and passes one
// it does, to the test at hand.
func TestOpenAPITransportFailsOnAMismatch(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name, body string
		fails      bool
	}{
		{"a field of the wrong type", `{"accepted":"1","duplicates":0,"unmapped":0}`, true},
		{"the document's answer", `{"accepted":1,"duplicates":0,"unmapped":0}`, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			server := roundTripFunc(func(*http.Request) (*http.Response, error) {
				return &http.Response{StatusCode: http.StatusAccepted, Body: io.NopCloser(bytes.NewReader([]byte(tc.body))),
					Header: http.Header{"Content-Type": {"application/json"}, "X-Request-Id": {"r1"}}}, nil
			})
			rec := &recordingTB{TB: t}
			client := &http.Client{Transport: openAPITransport{t: rec, base: server}}
			req, err := http.NewRequest(http.MethodPost, "http://node.test/v1/usage",
				bytes.NewReader([]byte(`{"events":[{"id":"e1","tenant":"acme","feature":"api_calls","value":1}]}`)))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Authorization", "Bearer x")
			req.Header.Set("Content-Type", "application/json")
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			got, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if string(got) != tc.body {
				t.Fatalf("the caller reads the answer as sent: %q", got)
			}
			if failed := len(rec.errors) > 0; failed != tc.fails {
				t.Fatalf("mismatch reported: %v, want %v: %q", failed, tc.fails, rec.errors)
			}
		})
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// recordingTB records Errorf instead of failing.
type recordingTB struct {
	testing.TB
	mu     sync.Mutex
	errors []string
}

func (r *recordingTB) Errorf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errors = append(r.errors, fmt.Sprintf(format, args...))
}
