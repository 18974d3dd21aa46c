package api_test

import (
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
	"github.com/tallymeter/tally/internal/auth"
)

// Every request is logged once, as JSON, with the request id it was
// answered with, its route pattern and status — never the token, the
// path's ids or the query.
func TestAccessLogHasRequestIDAndNoSecret(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	logs := &syncBuffer{}
	srv := httptest.NewServer(api.New(api.Options{
		Logger: slog.New(slog.NewJSONHandler(logs, nil)),
		V1:     &api.Deps{Pool: h.pool, Outbox: h.parts.Outbox, Mappings: h.parts.Mappings, Ingester: h.parts.Ingester, Requeuer: h.parts.Requeuer},
	}))
	defer srv.Close()
	secret := h.token("fin", auth.RoleFinance)

	get := func(path, requestID string) *http.Response {
		req, err := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+secret)
		if requestID != "" {
			req.Header.Set("X-Request-Id", requestID)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp
	}
	resp := get("/v1/outbox/items/4242?state=x", "")
	require.Equal(t, http.StatusNotFound, resp.StatusCode)
	id := resp.Header.Get("X-Request-Id")
	require.NotEmpty(t, id)
	kept := get("/v1/outbox/summary", "trace-abc.123")
	require.Equal(t, "trace-abc.123", kept.Header.Get("X-Request-Id"))
	replaced := get("/v1/outbox/summary", "bad id\twith\"quotes")
	require.NotContains(t, replaced.Header.Get("X-Request-Id"), "quotes")

	var lines []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &m), line)
		lines = append(lines, m)
	}
	require.Len(t, lines, 3)
	require.Equal(t, "request", lines[0]["msg"])
	require.Equal(t, id, lines[0]["request_id"])
	require.Equal(t, "/v1/outbox/items/{id}", lines[0]["route"])
	require.Equal(t, float64(404), lines[0]["status"])
	require.Equal(t, "trace-abc.123", lines[1]["request_id"])
	require.NotContains(t, logs.String(), secret)
	require.NotContains(t, logs.String(), "4242")
	require.NotContains(t, logs.String(), "state=x")
}
