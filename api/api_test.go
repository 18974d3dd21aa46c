package api_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/api"
)

func TestReadiness(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		checks []api.Check
		status int
		body   string
	}{
		{"all hold", []api.Check{{Name: "database", Func: func(context.Context) error { return nil }}},
			http.StatusOK, `{"status":"ready","checks":{"database":"ok"}}`},
		{"one fails", []api.Check{
			{Name: "database", Func: func(context.Context) error { return nil }},
			{Name: "schema", Func: func(context.Context) error { return errors.New("behind") }},
		}, http.StatusServiceUnavailable, `{"status":"not_ready","checks":{"database":"ok","schema":"behind"}}`},
		{"a hung check times out", []api.Check{{Name: "slow", Func: func(ctx context.Context) error {
			<-ctx.Done()
			return errors.New("timed out")
		}}}, http.StatusServiceUnavailable, `{"status":"not_ready","checks":{"slow":"timed out"}}`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			h := api.New(api.Options{Ready: tc.checks, CheckTimeout: 50e6})
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/readyz", nil))
			require.Equal(t, tc.status, rec.Code)
			require.JSONEq(t, tc.body, rec.Body.String())
			require.Equal(t, "application/json", rec.Header().Get("Content-Type"))
		})
	}
}

func TestErrorsAndMethods(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(api.New(api.Options{}))
	defer srv.Close()
	resp, err := http.Post(srv.URL+"/healthz", "application/json", nil)
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
	require.JSONEq(t, `{"error":{"code":"method_not_allowed","message":"method not allowed on this route"}}`, string(b))
	resp, err = http.Get(srv.URL + "/metrics")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusNotFound, resp.StatusCode, "no metrics handler, no route")
}
