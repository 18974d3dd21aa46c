package api_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/internal/auth"
	"github.com/tallymeter/tally/meter"
)

// Requests posted at the same time share transactions (serve's defaults
// group them), and each is still answered on its own: a request
// refused — an id stored before with other content, a correction its token
// may not post — stores nothing of its own and fails no other.
func TestConcurrentPostsAreEachAnsweredOnTheirOwn(t *testing.T) {
	t.Parallel()
	h := newHarness(t, false)
	ingest := h.as(h.token("ingest", auth.RoleIngest))
	stored := validEvent()
	stored["id"] = "stored-1"
	require.Equal(t, http.StatusAccepted, h.request(http.MethodPost, "/v1/usage", ingest, map[string]any{"events": []event{stored}}).status)

	changed := validEvent()
	changed["id"], changed["value"] = "stored-1", 2
	const valid = 36
	type post struct {
		events []event
		want   int
	}
	var posts []post
	for i := range valid {
		e := validEvent()
		e["id"] = fmt.Sprintf("g-%d", i)
		posts = append(posts, post{[]event{e}, http.StatusAccepted})
	}
	for i := range 2 {
		e := validEvent()
		e["id"] = fmt.Sprintf("x-%d", i)
		posts = append(posts, post{[]event{e, changed}, http.StatusUnprocessableEntity})
	}
	correction := validEvent()
	correction["id"], correction["value"] = "x-correction", -1
	posts = append(posts, post{[]event{correction}, http.StatusForbidden})
	again := validEvent()
	again["id"] = "g-0"
	posts = append(posts, post{[]event{again}, http.StatusAccepted})

	answers := make([]response, len(posts))
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i, p := range posts {
		wg.Go(func() {
			<-start
			answers[i] = h.try(http.MethodPost, "/v1/usage", ingest, map[string]any{"events": p.events})
		})
	}
	close(start)
	wg.Wait()
	var accepted, duplicates int
	for i, p := range posts {
		require.Equal(t, p.want, answers[i].status, "post %d: %s", i, answers[i])
		if p.want != http.StatusAccepted {
			continue
		}
		var res meter.Result
		require.NoError(t, json.Unmarshal(answers[i].body, &res))
		require.Equal(t, 1, res.Accepted+res.Duplicates, "post %d", i)
		accepted, duplicates = accepted+res.Accepted, duplicates+res.Duplicates
	}
	require.Equal(t, valid, accepted)
	require.Equal(t, 1, duplicates, "g-0 twice: one stores it, the other is its duplicate")
	var problem struct {
		Error struct {
			Problems []meter.Problem `json:"problems"`
		} `json:"error"`
	}
	require.NoError(t, json.Unmarshal(answers[valid].body, &problem))
	require.Len(t, problem.Error.Problems, 1)
	require.Equal(t, 1, *problem.Error.Problems[0].Index, "the problem is indexed in its own batch")
	require.Equal(t, int64(valid+1), h.count("SELECT count(*) FROM usage_events"), "nothing of a refused request is stored")
	require.Equal(t, int64(0), h.count("SELECT count(*) FROM usage_events WHERE event_id LIKE 'x-%'"))
}
