package console

import (
	"container/list"
	"math"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"golang.org/x/time/rate"

	"github.com/tallymeter/tally/internal/httpsec"
)

// The sign-in throttle's defaults: failed sign-ins a client address may
// make at once and how fast it earns another, the same for all addresses
// together, and how many addresses are remembered.
const (
	defaultSignInFailures           = 10
	defaultSignInFailureEvery       = time.Minute
	defaultSignInGlobalFailures     = 100
	defaultSignInGlobalFailureEvery = 100 * time.Millisecond
	defaultSignInAddresses          = 10_000
	// Refused sign-ins audited one by one: this many at once, node-wide,
	// then one a second; the rest are counted and logged once a minute.
	defaultRefusalAudits     = 100
	defaultRefusalAuditEvery = time.Second
	refusalReportEvery       = time.Minute
)

// signInLimits size a signInThrottle.
type signInLimits struct {
	// Failures a client address may make at once, and one more each Every.
	Failures int
	Every    time.Duration
	// GlobalFailures all addresses together may make at once, and one more
	// each GlobalEvery.
	GlobalFailures int
	GlobalEvery    time.Duration
	// Addresses is how many client addresses are remembered; past it the
	// least recently seen is forgotten.
	Addresses int
}

func defaultSignInLimits() signInLimits {
	return signInLimits{Failures: defaultSignInFailures, Every: defaultSignInFailureEvery,
		GlobalFailures: defaultSignInGlobalFailures, GlobalEvery: defaultSignInGlobalFailureEvery,
		Addresses: defaultSignInAddresses}
}

// clientAddr is the address a request comes from, for the sign-in throttle
// and the audit log: the client's, as httpsec worked it out (behind a
// trusted proxy, the address the proxy names; else the connection's peer).
// It returns a parsed address (never a header's raw text), or "unknown".
func clientAddr(r *http.Request) string {
	a, err := netip.ParseAddr(httpsec.ClientAddr(r))
	if err != nil {
		return "unknown"
	}
	return a.Unmap().WithZone("").String()
}

// throttleKey groups addresses that one client plausibly holds together:
// an IPv4 address alone, an IPv6 address by its /64.
func throttleKey(addr string) string {
	a, err := netip.ParseAddr(addr)
	if err != nil || a.Is4() {
		return addr
	}
	p, _ := a.Prefix(64)
	return p.String()
}

// bucket is one limiter with the attempts admitted by it and not yet
// finished: an attempt in flight holds a token it may still spend, so
// concurrent attempts cannot overshoot the limit.
type bucket struct {
	lim     *rate.Limiter
	pending int
}

// wait is how long until b admits one more attempt (0: now).
func (b *bucket) wait(now time.Time) time.Duration {
	tokens := b.lim.TokensAt(now) - float64(b.pending)
	if tokens >= 1 {
		return 0
	}
	return time.Duration((1 - tokens) / float64(b.lim.Limit()) * float64(time.Second))
}

type addrBucket struct {
	key string
	bucket
}

// signInThrottle limits failed sign-ins per client address and for all
// addresses together, on this node. Its memory is bounded: it remembers at
// most limits.Addresses addresses, forgetting the least recently seen
// first. An attempt over either limit is refused before its token is
// looked at.
type signInThrottle struct {
	limits signInLimits
	now    func() time.Time

	mu     sync.Mutex
	global bucket
	// audits bounds the refused sign-ins audited one by one; unaudited
	// counts the others since lastReport.
	audits     *rate.Limiter
	unaudited  int
	lastReport time.Time
	// addrs indexes order's elements (*addrBucket) by throttleKey; order
	// has the most recently seen address at its front.
	addrs map[string]*list.Element
	order *list.List
}

func newSignInThrottle(l signInLimits) *signInThrottle {
	return &signInThrottle{limits: l, now: time.Now,
		global: bucket{lim: rate.NewLimiter(rate.Every(l.GlobalEvery), l.GlobalFailures)},
		audits: rate.NewLimiter(rate.Every(defaultRefusalAuditEvery), defaultRefusalAudits),
		addrs:  map[string]*list.Element{}, order: list.New()}
}

// signInAttempt is an admitted attempt: finish it once its outcome is
// known.
type signInAttempt struct {
	t    *signInThrottle
	addr *addrBucket
}

// admit admits an attempt from addr, or answers how long the client must
// wait (rounded up to a whole second).
func (t *signInThrottle) admit(addr string) (signInAttempt, time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	key := throttleKey(addr)
	var ab *addrBucket
	if el, ok := t.addrs[key]; ok {
		t.order.MoveToFront(el)
		ab = el.Value.(*addrBucket)
	} else {
		ab = &addrBucket{key: key, bucket: bucket{lim: rate.NewLimiter(rate.Every(t.limits.Every), t.limits.Failures)}}
		t.addrs[key] = t.order.PushFront(ab)
		for t.order.Len() > t.limits.Addresses {
			oldest := t.order.Back()
			t.order.Remove(oldest)
			delete(t.addrs, oldest.Value.(*addrBucket).key)
		}
	}
	// The global limit holds back only addresses that failed lately: an
	// address with its whole allowance left (an operator who has not
	// mistyped) is never locked out by others' failures.
	d := ab.wait(now)
	if ab.lim.TokensAt(now)-float64(ab.pending) < float64(ab.lim.Burst()) {
		d = max(d, t.global.wait(now))
	}
	if d > 0 {
		return signInAttempt{}, time.Duration(math.Ceil(d.Seconds())) * time.Second
	}
	ab.pending++
	t.global.pending++
	return signInAttempt{t: t, addr: ab}, 0
}

// finish ends the attempt: a failed one spends a token of its address and
// of the global limit, a successful one spends nothing.
func (a signInAttempt) finish(failed bool) {
	t := a.t
	t.mu.Lock()
	defer t.mu.Unlock()
	a.addr.pending--
	t.global.pending--
	if failed {
		now := t.now()
		a.addr.lim.AllowN(now, 1)
		t.global.lim.AllowN(now, 1)
	}
}

// auditRefusal says whether a refused sign-in gets an audit row of its own:
// at most defaultRefusalAudits at once, node-wide, then one a second, so
// that a flood from many addresses cannot fill the audit log, from which
// nothing is deleted. The refusals it holds back are counted; report is
// how many since the last report, answered at most once a minute (0: not
// now), for the node's log.
func (t *signInThrottle) auditRefusal() (record bool, report int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	if t.audits.AllowN(now, 1) {
		return true, 0
	}
	t.unaudited++
	if now.Sub(t.lastReport) < refusalReportEvery {
		return false, 0
	}
	report, t.unaudited, t.lastReport = t.unaudited, 0, now
	return false, report
}

// size is how many addresses the throttle remembers.
func (t *signInThrottle) size() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.order.Len()
}
