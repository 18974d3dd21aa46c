package console_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/outbox"
	"github.com/tallymeter/tally/reconcile"
)

// The uncertain page lists an uncertain item with its attempts, refusals
// and last error, also once a reconcile run has succeeded (whose plan has
// nothing to suggest for it). (Plain HTTP: this runs without a browser.)
func TestUncertainPageListsTheItems(t *testing.T) {
	t.Parallel()
	s := newSite(t)
	leases, err := s.env.Outbox.Claim(s.env.Ctx, s.env.Pool, outbox.ClaimOptions{Owner: "test", Limit: 1})
	require.NoError(t, err)
	require.Len(t, leases, 1)
	require.NoError(t, s.env.Outbox.MarkUncertain(s.env.Ctx, s.env.Pool, leases[0], outbox.ErrorInfo{Code: "timeout", Status: 504}, true))

	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar}
	resp, err := postSignIn(client, s.url, s.token(t, "olive", auth.RoleOperator))
	require.NoError(t, err)
	resp.Body.Close()
	get := func() string {
		t.Helper()
		resp, err := client.Get(s.url + "/console/uncertain")
		require.NoError(t, err)
		defer resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode)
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return string(b)
	}
	page := get()
	require.Contains(t, page, fmt.Sprintf(`data-testid="item-%d"`, leases[0].ID))
	require.Contains(t, page, "1 (1 refused)")
	require.Contains(t, page, "timeout (504)")

	run, err := reconcile.Queue(s.env.Ctx, s.env.Pool, reconcile.TriggerAPI, "test", reconcile.Options{})
	require.NoError(t, err)
	_, err = s.env.Pool.Exec(s.env.Ctx, `UPDATE reconcile_runs SET status = 'succeeded', finished_at = clock_timestamp() WHERE id = $1`, run)
	require.NoError(t, err)
	require.Contains(t, get(), fmt.Sprintf(`data-testid="item-%d"`, leases[0].ID))
}
