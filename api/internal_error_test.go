package api

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// A query the pool's statement_timeout cut answers 503 statement_timeout
// while its client still waits, and a transaction the database cancelled
// for a concurrent one 503 retry; any other failure (and a cancel because
// the client left) stays a 500 that says nothing of the error.
func TestInternalErrorsTellATimeoutFromAFailure(t *testing.T) {
	t.Parallel()
	h := &handlers{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	cut := fmt.Errorf("quarantine: reading: %w", &pgconn.PgError{Code: "57014", Message: "canceling statement due to statement timeout"})
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	for _, tc := range []struct {
		name   string
		ctx    context.Context
		err    error
		status int
		code   string
	}{
		{"timeout", context.Background(), cut, http.StatusServiceUnavailable, `"statement_timeout"`},
		{"deadlock victim", context.Background(), fmt.Errorf("meter: ingest: %w", &pgconn.PgError{Code: "40P01", Message: "canceling the transaction since it was involved in a distributed deadlock"}),
			http.StatusServiceUnavailable, `"retry"`},
		{"serialization failure", context.Background(), &pgconn.PgError{Code: "40001", Message: "canceling statement"}, http.StatusServiceUnavailable, `"retry"`},
		{"client left", gone, cut, http.StatusInternalServerError, `"internal"`},
		{"other", context.Background(), errors.New("relation secret_table does not exist"), http.StatusInternalServerError, `"internal"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			r := httptest.NewRequest(http.MethodGet, "/v1/report/completeness", nil)
			r = r.WithContext(context.WithValue(tc.ctx, chi.RouteCtxKey, chi.NewRouteContext()))
			w := httptest.NewRecorder()
			h.internal(w, r, tc.err)
			if w.Code != tc.status || !strings.Contains(w.Body.String(), tc.code) {
				t.Fatalf("got %d %s, want %d with %s", w.Code, w.Body, tc.status, tc.code)
			}
			if strings.Contains(w.Body.String(), "secret_table") || strings.Contains(w.Body.String(), "canceling") {
				t.Fatalf("the answer tells the error: %s", w.Body)
			}
		})
	}
}
