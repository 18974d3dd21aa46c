package outbox_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tallymeter/tally/outbox"
)

// The known answers were computed outside Go:
//
//	printf '%s' 'acme|usage_window|...|live|3' | sha256sum
func TestIdentifierKnownAnswers(t *testing.T) {
	t.Parallel()
	window := outbox.Identity{
		TenantKey:          "acme",
		SubjectKind:        outbox.SubjectUsageWindow,
		SubjectRef:         "usage:api_calls:2026-11-01T00:00:00Z:2026-11-30T10:00:00Z:2026-11-30T11:00:00Z",
		Exporter:           "stripe_meter_events",
		DestinationAccount: "acct_1Nv0FGQ9RKHgCVdK",
		Mode:               outbox.ModeLive,
		MappingVersion:     3,
	}
	supplement := window
	supplement.SubjectRef += "#2"
	event := outbox.Identity{
		TenantKey:      "tenant-ü",
		SubjectKind:    outbox.SubjectUsageEvent,
		SubjectRef:     "event:api_calls:evt_0001",
		Exporter:       "stripe_meter_event_stream",
		Mode:           outbox.ModeTest,
		MappingVersion: 0,
	}
	cases := []struct {
		name string
		id   outbox.Identity
		want string
	}{
		{"window", window, "tly_50788159d53f9b6ac205d736268501b1d0630fd6b781323533ea0190ac3444a8"},
		{"supplement", supplement, "tly_d5d948eeba0f70bb88307837aae4eb8c1de2eadb8261f880baa7a6ba9a1aa7d3"},
		{"event, utf-8, no account", event, "tly_70d74b89160ffddd07aca735b3b9d59d583ee70b2c28c2073f295b4ba05b7c63"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.id.Identifier()
			require.Equal(t, tc.want, got)
			require.Len(t, got, 68)
			require.Equal(t, outbox.IdentifierLength, len(got))
		})
	}
	// Every field of the identity changes the identifier.
	edits := []func(*outbox.Identity){
		func(i *outbox.Identity) { i.TenantKey = "acme2" },
		func(i *outbox.Identity) { i.SubjectKind = "usage_event" },
		func(i *outbox.Identity) { i.SubjectRef += "x" },
		func(i *outbox.Identity) { i.Exporter = "stripe_meter_event_stream" },
		func(i *outbox.Identity) { i.DestinationAccount = "acct_2" },
		func(i *outbox.Identity) { i.Mode = outbox.ModeTest },
		func(i *outbox.Identity) { i.MappingVersion = 4 },
	}
	for _, edit := range edits {
		id := window
		edit(&id)
		require.NotEqual(t, window.Identifier(), id.Identifier())
	}
}

// The database's generated identifier column is the same function.
func TestIdentifierMatchesDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	items := []outbox.NewItem{newItem(1), newItem(2)}
	items[1].TenantKey = "tenant-ü ✓"
	items[1].MappingVersion = 12345
	ids := b.enqueue(t, items...)
	for i, id := range ids {
		require.Equal(t, items[i].Identity.Identifier(), b.get(t, id).Identifier)
	}
}

func TestBackoffKnownAnswers(t *testing.T) {
	t.Parallel()
	base, cap := 5*time.Second, 900*time.Second
	want := map[int]time.Duration{
		0: 5 * time.Second, 1: 5 * time.Second, 2: 10 * time.Second, 3: 20 * time.Second, 4: 40 * time.Second,
		5: 80 * time.Second, 6: 160 * time.Second, 7: 320 * time.Second, 8: 640 * time.Second,
		9: 900 * time.Second, 10: 900 * time.Second, 20: 900 * time.Second, 64: 900 * time.Second, 1000: 900 * time.Second,
	}
	for attempts, w := range want {
		require.Equal(t, w, outbox.Backoff(attempts, base, cap), "attempts %d", attempts)
	}
	// The arithmetic of docs/outbox.md ("Retry and backoff"): 5+10+...+640 s,
	// then eleven waits of 900 s, put the twentieth attempt 3 h 6 m 15 s
	// after the first before jitter (at most a quarter more: under four
	// hours), well inside the 20 h horizon.
	var total time.Duration
	for a := 1; a < 20; a++ {
		total += outbox.Backoff(a, base, cap)
	}
	require.Equal(t, 3*time.Hour+6*time.Minute+15*time.Second, total)
}

func TestJitterBounds(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{time.Millisecond, 5 * time.Second, 900 * time.Second} {
		lo, hi := d, d
		for i := 0; i < 2000; i++ {
			j := outbox.Jitter(d)
			require.GreaterOrEqual(t, j, d)
			require.LessOrEqual(t, j, d+d/4)
			lo, hi = min(lo, j), max(hi, j)
		}
		// The jitter is spread over its range, not a constant.
		require.Less(t, lo, d+d/16, "d=%s", d)
		require.Greater(t, hi, d+3*d/16, "d=%s", d)
	}
	require.Equal(t, time.Duration(0), outbox.Jitter(0))
}

func TestErrorInfoSanitized(t *testing.T) {
	t.Parallel()
	long := make([]rune, 500)
	for i := range long {
		long[i] = 'é'
	}
	cases := []struct {
		name string
		in   outbox.ErrorInfo
		want outbox.ErrorInfo
	}{
		{"clean", outbox.ErrorInfo{Code: "stripe_5xx", Status: 503, Message: "service unavailable"},
			outbox.ErrorInfo{Code: "stripe_5xx", Status: 503, Message: "service unavailable"}},
		{"code folded", outbox.ErrorInfo{Code: "  Stripe API Error!! "},
			outbox.ErrorInfo{Code: "stripe_api_error"}},
		{"empty code", outbox.ErrorInfo{Message: "x"}, outbox.ErrorInfo{Code: "error", Message: "x"}},
		{"status out of range", outbox.ErrorInfo{Code: "x", Status: 1234}, outbox.ErrorInfo{Code: "x"}},
		{"secret as code", outbox.ErrorInfo{Code: "sk_live_51Habc123"}, outbox.ErrorInfo{Code: "redacted"}},
		{"secrets redacted", outbox.ErrorInfo{Code: "x", Message: "key sk_live_51Habc123 and rk_test_9 and Bearer abc.def and whsec_zzz"},
			outbox.ErrorInfo{Code: "x", Message: "key [redacted] and [redacted] and [redacted] and [redacted]"}},
		{"masked key, as Stripe's 401 shows it", outbox.ErrorInfo{Code: "x", Message: "Invalid API Key provided: sk_test_********************1x2Y"},
			outbox.ErrorInfo{Code: "x", Message: "Invalid API Key provided: [redacted]"}},
		{"control characters and whitespace", outbox.ErrorInfo{Code: "x", Message: "a\x00b\n\n\tc\x1b[31m"},
			outbox.ErrorInfo{Code: "x", Message: "ab c[31m"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			require.Equal(t, tc.want, tc.in.Sanitized())
		})
	}
	got := outbox.ErrorInfo{Code: "x", Message: string(long)}.Sanitized()
	require.Equal(t, outbox.MaxErrorMessage, len([]rune(got.Message)))
	long64 := outbox.ErrorInfo{Code: strings.Repeat("stripe.", 12)}.Sanitized()
	require.Len(t, long64.Code, 64)
}

// A sanitised error always fits the database's CHECK constraints.
func TestSanitizedErrorFitsDatabase(t *testing.T) {
	t.Parallel()
	b := setup(t, outbox.Config{})
	b.enqueue(t, newItem(1))
	l := b.claimOne(t)
	msg := ""
	for i := 0; i < 100; i++ {
		msg += "ünïcödé "
	}
	_, err := b.store.Retry(b.ctx, b.pool, l, outbox.ErrorInfo{Code: "__Weird Code__/?", Status: -5, Message: msg}, false)
	require.NoError(t, err)
	it := b.get(t, l.ID)
	require.Equal(t, "weird_code", it.LastError.Code)
	require.Zero(t, it.LastError.Status)
	require.Equal(t, outbox.MaxErrorMessage, len([]rune(it.LastError.Message)))
}
