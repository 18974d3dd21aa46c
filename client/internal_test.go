package client

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestRetryAfter(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 11, 30, 10, 0, 0, 0, time.UTC)
	cases := []struct {
		header string
		want   time.Duration
	}{
		{"", 0},
		{"soon", 0},
		{"-3", 0},
		{"0", 0},
		{"1.5", 0},
		{now.Add(-time.Minute).Format(http.TimeFormat), 0},
		{"7", 7 * time.Second},
		{" 2 ", 2 * time.Second},
		{"99999999999", 24 * time.Hour},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second},
		{now.Add(30 * time.Second).Format(time.RFC850), 30 * time.Second},
	}
	for _, tc := range cases {
		require.Equal(t, tc.want, retryAfter(tc.header, now), "%q", tc.header)
	}
}

func TestSplitKeepsEveryRequestWithinItsLimits(t *testing.T) {
	t.Parallel()
	enc := func(sizes ...int) [][]byte {
		out := make([][]byte, len(sizes))
		for i, n := range sizes {
			out[i] = make([]byte, n)
		}
		return out
	}
	cases := []struct {
		name      string
		events    [][]byte
		maxEvents int
		maxBytes  int
		want      []span
	}{
		{"one event", enc(10), 10, 100, []span{{0, 1}}},
		{"by count", enc(1, 1, 1, 1, 1), 2, 1000, []span{{0, 2}, {2, 4}, {4, 5}}},
		// A body is 13 bytes of framing, the events and a comma between each two.
		{"exactly the bytes", enc(10, 10, 10), 10, 13 + 10 + 1 + 10, []span{{0, 2}, {2, 3}}},
		{"a byte short", enc(10, 10, 10), 10, 13 + 10 + 1 + 10 - 1, []span{{0, 1}, {1, 2}, {2, 3}}},
		{"an event that fills a request alone", enc(5, 87, 5), 10, 100, []span{{0, 1}, {1, 2}, {2, 3}}},
	}
	for _, tc := range cases {
		got := split(tc.events, tc.maxEvents, tc.maxBytes)
		require.Equal(t, tc.want, got, tc.name)
		for _, s := range got {
			size := 0
			for _, e := range tc.events[s.from:s.to] {
				size += len(e)
			}
			require.LessOrEqual(t, len(body(tc.events[s.from:s.to])), tc.maxBytes, tc.name)
			require.Equal(t, bodySize(s.to-s.from, size), len(body(tc.events[s.from:s.to])), tc.name)
		}
	}
}

func TestEventEncodingIsStable(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 11, 30, 10, 0, 0, 123456789, time.FixedZone("X", 3600))
	ev := Event{ID: `a"<b>`, Tenant: "acme", Feature: "api_calls", Value: -2, Timestamp: at}
	b, err := ev.encode()
	require.NoError(t, err)
	require.JSONEq(t, `{"id":"a\"<b>","tenant":"acme","feature":"api_calls","value":-2,"timestamp":"2026-11-30T09:00:00.123456789Z"}`, string(b))
	again, err := ev.encode()
	require.NoError(t, err)
	require.Equal(t, b, again)
	none, err := Event{ID: "x", Tenant: "t", Feature: "f", Value: 1}.encode()
	require.NoError(t, err)
	require.NotContains(t, string(none), "timestamp", "no timestamp is sent for a zero one")
	stamped := Event{}.stampNow(at)
	require.Equal(t, at.UTC().Truncate(time.Microsecond), stamped.Timestamp)
	require.Equal(t, at, Event{Timestamp: at}.stampNow(time.Now()).Timestamp, "a timestamp given is kept")
}

// A refusal counts its problems in words that agree with the count.
func TestInvalidErrorCountsItsProblems(t *testing.T) {
	t.Parallel()
	status := StatusError{StatusCode: http.StatusUnprocessableEntity, Code: "invalid_batch"}
	one := &InvalidError{StatusError: status, Problems: []Problem{{Field: "id", Reason: "required"}}}
	require.Contains(t, one.Error(), "(422 invalid_batch): 1 problem, the first: ")
	two := &InvalidError{StatusError: status, Problems: []Problem{{Field: "id", Reason: "required"}, {Field: "value", Reason: "required"}}}
	require.Contains(t, two.Error(), "(422 invalid_batch): 2 problems, the first: ")
}
