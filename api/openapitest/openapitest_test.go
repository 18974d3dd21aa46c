package openapitest_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api/openapitest"
)

// exchange is one request and its answer, as Check takes them.
type exchange struct {
	method, path, reqBody string
	status                int
	header                map[string]string // besides X-Request-Id and Content-Type
	respBody              string
	noRequestID           bool
}

func (x exchange) check(t *testing.T) error {
	t.Helper()
	c, err := openapitest.Default()
	require.NoError(t, err)
	req := httptest.NewRequest(x.method, "http://tally.test"+x.path, strings.NewReader(x.reqBody))
	req.Header.Set("Authorization", "Bearer secret-token-never-quoted")
	if x.reqBody != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp := &http.Response{StatusCode: x.status, Header: http.Header{}}
	if !x.noRequestID {
		resp.Header.Set("X-Request-Id", "req-1")
	}
	if x.respBody != "" {
		resp.Header.Set("Content-Type", "application/json")
	}
	for k, v := range x.header {
		resp.Header.Set(k, v)
	}
	return c.Check(req, []byte(x.reqBody), resp, []byte(x.respBody))
}

const (
	goodBatch  = `{"events":[{"id":"e1","tenant":"acme","feature":"api_calls","value":3,"timestamp":"2026-11-30T10:15:00Z"}]}`
	goodResult = `{"accepted":1,"duplicates":0,"unmapped":0}`
	goodItem   = `{"id":7,"tenant":"acme","subject_kind":"usage_event","subject_ref":"e1","exporter":"stripe_meter_events",
		"destination_account":"acct_1","mode":"test","mapping_version":2,"identifier":"tly_00",
		"payload":{"customer":"cus_1","event_name":"api_calls","value":3,"timestamp":1764497700,"identifier":"tly_00","feature":"api_calls","period":"2026-11-01T00:00:00Z"},
		"state":"pending","attempts":0,"lease_token":0,"next_attempt_at":"2026-11-30T10:15:00Z",
		"created_at":"2026-11-30T10:15:00Z","updated_at":"2026-11-30T10:15:00.123456Z"}`
)

// TestCheckFindsEveryKindOfMismatch feeds Check exchanges the document does
// not describe — the answers a drifting server would give — and expects
// each to be named: the check cannot pass silently.
func TestCheckFindsEveryKindOfMismatch(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		x    exchange
		want string // in the error
	}{
		{"a field of the wrong type", exchange{method: "POST", path: "/v1/usage", reqBody: goodBatch, status: 202,
			respBody: `{"accepted":"1","duplicates":0,"unmapped":0}`}, "accepted"},
		{"a field missing", exchange{method: "POST", path: "/v1/usage", reqBody: goodBatch, status: 202,
			respBody: `{"accepted":1,"duplicates":0}`}, "unmapped"},
		{"a field the document does not declare", exchange{method: "POST", path: "/v1/usage", reqBody: goodBatch, status: 202,
			respBody: `{"accepted":1,"duplicates":0,"unmapped":0,"stored_at":"now"}`}, "stored_at"},
		{"a time that is not RFC 3339", exchange{method: "GET", path: "/v1/outbox/items/7", status: 200,
			respBody: strings.Replace(goodItem, `"created_at":"2026-11-30T10:15:00Z"`, `"created_at":"30/11/2026"`, 1)}, "created_at"},
		{"a state that is none of the outbox's", exchange{method: "GET", path: "/v1/outbox/items/7", status: 200,
			respBody: strings.Replace(goodItem, `"state":"pending"`, `"state":"parked"`, 1)}, "state"},
		{"a status the operation does not document", exchange{method: "POST", path: "/v1/usage", reqBody: goodBatch, status: 418,
			respBody: `{"error":{"code":"teapot","message":"no"}}`}, "418"},
		{"an error code the answer does not list", exchange{method: "POST", path: "/v1/usage", reqBody: goodBatch, status: 400,
			respBody: `{"error":{"code":"rate_limited","message":"slow down"}}`}, `"rate_limited" is not one the document lists`},
		{"an error not in the error shape", exchange{method: "POST", path: "/v1/usage", reqBody: goodBatch, status: 400,
			respBody: `{"code":"invalid_json","message":"bad"}`}, "400"},
		{"problems of the wrong shape", exchange{method: "POST", path: "/v1/usage", reqBody: `{}`, status: 422,
			respBody: `{"error":{"code":"invalid_batch","message":"1 problem","problems":[{"index":"0","field":"events","reason":"required"}]}}`}, "index"},
		{"a 429 without Retry-After", exchange{method: "POST", path: "/v1/usage", reqBody: goodBatch, status: 429,
			respBody: `{"error":{"code":"rate_limited","message":"slow down"}}`}, "Retry-After"},
		{"a 401 without WWW-Authenticate", exchange{method: "GET", path: "/v1/audit", status: 401,
			respBody: `{"error":{"code":"unauthorized","message":"send a token"}}`}, "WWW-Authenticate"},
		{"an answer without X-Request-Id", exchange{method: "POST", path: "/v1/usage", reqBody: goodBatch, status: 202,
			respBody: goodResult, noRequestID: true}, "X-Request-Id"},
		{"a request the server took and the document refuses", exchange{method: "POST", path: "/v1/usage",
			reqBody: `{"events":[{"id":"e1","tenant":"acme","feature":"api_calls","value":"3"}]}`, status: 202,
			respBody: goodResult}, "the request, which the server took"},
		{"a value over int64, taken", exchange{method: "POST", path: "/v1/usage",
			reqBody: `{"events":[{"id":"e1","tenant":"acme","feature":"api_calls","value":10000000000000000000}]}`, status: 202,
			respBody: goodResult}, "value"},
		{"a query parameter the document does not know, taken", exchange{method: "GET", path: "/v1/outbox/items?states=pending", status: 200,
			respBody: `{"items":[]}`}, "states"},
		{"a limit over the document's, taken", exchange{method: "GET", path: "/v1/outbox/items?limit=5000", status: 200,
			respBody: `{"items":[]}`}, "limit"},
		{"an undocumented route that answers", exchange{method: "GET", path: "/v1/nope", status: 200,
			respBody: `{"ok":true}`}, "document it"},
		{"an undocumented method that answers", exchange{method: "DELETE", path: "/v1/outbox/items/7", status: 204}, "no DELETE operation"},
		{"an unknown route answered with another code", exchange{method: "GET", path: "/v1/nope", status: 404,
			respBody: `{"error":{"code":"no_route","message":"no such route"}}`}, "no_route"},
		{"an unknown route answered outside the error shape", exchange{method: "GET", path: "/v1/nope", status: 404,
			respBody: `{"message":"no such route"}`}, "not the error shape"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := tc.x.check(t)
			require.Error(t, err, "the document does not describe this exchange: Check must say so")
			require.Contains(t, err.Error(), tc.want)
			require.Contains(t, err.Error(), tc.x.method+" "+strings.SplitN(tc.x.path, "?", 2)[0], "the error names the route")
			require.NotContains(t, err.Error(), "secret-token-never-quoted", "an error never quotes a token")
		})
	}
}

func TestCheckPassesWhatTheDocumentDescribes(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		x    exchange
	}{
		{"usage stored", exchange{method: "POST", path: "/v1/usage", reqBody: goodBatch, status: 202, respBody: goodResult}},
		{"the edges of int64, exactly", exchange{method: "POST", path: "/v1/usage",
			reqBody: `{"events":[{"id":"max","tenant":"acme","feature":"api_calls","value":9223372036854775807},` +
				`{"id":"min","tenant":"acme","feature":"api_calls","value":-9223372036854775808,"timestamp":null}]}`,
			status: 202, respBody: `{"accepted":2,"duplicates":0,"unmapped":2}`}},
		{"an invalid batch refused, with its problems", exchange{method: "POST", path: "/v1/usage",
			reqBody: `{"events":[{"id":"e1","value":1.5}]}`, status: 422,
			respBody: `{"error":{"code":"invalid_batch","message":"3 problems; nothing was stored","problems":[` +
				`{"index":0,"field":"feature","reason":"required"},{"index":0,"field":"tenant","reason":"required"},` +
				`{"index":0,"field":"value","reason":"must be an integer"}]}}`}},
		{"a batch-level problem", exchange{method: "POST", path: "/v1/usage", reqBody: `{}`, status: 422,
			respBody: `{"error":{"code":"invalid_batch","message":"1 problem; nothing was stored","problems":[{"index":null,"field":"events","reason":"required: an array of events"}]}}`}},
		{"throttled", exchange{method: "POST", path: "/v1/usage", reqBody: goodBatch, status: 429, header: map[string]string{"Retry-After": "2"},
			respBody: `{"error":{"code":"rate_limited","message":"slow down"}}`}},
		{"an item", exchange{method: "GET", path: "/v1/outbox/items/7", status: 200, respBody: goodItem}},
		{"a page of items", exchange{method: "GET", path: "/v1/outbox/items?state=pending&limit=10", status: 200,
			respBody: `{"items":[` + goodItem + `],"next_after":7}`}},
		{"an unknown route, 401 before 404", exchange{method: "GET", path: "/v1/nope", status: 401,
			header:   map[string]string{"WWW-Authenticate": `Bearer realm="tally"`},
			respBody: `{"error":{"code":"unauthorized","message":"send Authorization: Bearer <token>"}}`}},
		{"an unknown method", exchange{method: "DELETE", path: "/v1/outbox/items/7", status: 405,
			respBody: `{"error":{"code":"method_not_allowed","message":"method not allowed on this route"}}`}},
		{"not the API", exchange{method: "GET", path: "/healthz", status: 200, respBody: `{"status":"ok"}`}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.NoError(t, tc.x.check(t))
		})
	}
}

func TestNewRefusesABrokenDocument(t *testing.T) {
	t.Parallel()
	for name, doc := range map[string]string{
		"not JSON":       `{"openapi":`,
		"no Error shape": `{"openapi":"3.1.0","info":{"title":"t","version":"1"},"paths":{}}`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			_, err := openapitest.New([]byte(doc))
			require.Error(t, err)
		})
	}
}
