package exporter

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tallymeter/tally/internal/stripeapi"
)

// Connected accounts (Stripe Connect). A tenant mapping may name a
// connected account (stripe_account): its items are staged for that
// account, sent with Stripe-Account, and reconciled there. The node's own
// destination (Destination.Account: STRIPE_ACCOUNT, or the key's own
// account) takes every other tenant's items.
//
// A connected account Stripe refuses the key's access to (account_invalid,
// or a 403 on a call for it) stalls alone: claims skip its items
// (outbox.ClaimOptions.SkipAccounts), which wait pending without an
// attempt, every other account's items keep flowing, and a probe (GET
// /v1/account for it, paced by the budget's Other class) every
// AccountProbeEvery finds when access is back. A refusal of the node's own
// destination, or a 401 (the key itself), stalls the whole node
// (Resolver.KeyRefused).

// AccountProbeEvery is how often a stalled connected account is probed.
const AccountProbeEvery = 15 * time.Second

// AccountStall is a connected account whose access Stripe refused.
type AccountStall struct {
	Account string    `json:"account"`
	Status  int       `json:"status"`
	Since   time.Time `json:"since"`
	// Probed is when its access was last asked about (zero: not yet).
	Probed time.Time `json:"probed,omitzero"`
}

// Connected is what a node knows of the connected accounts it exports to:
// which accounts tenant mappings have named, and which of them Stripe
// refused. It is safe for concurrent use.
type Connected struct {
	load   func(context.Context) ([]string, error)
	probe  func(ctx context.Context, account string) error
	logger *slog.Logger

	// onKnown runs once, when the first connected account becomes known
	// (the budget's meter-event classes start taking the basic bucket).
	onKnown func()

	mu      sync.Mutex
	known   map[string]bool
	stalled map[string]*AccountStall
	skip    []string // the stalled accounts, sorted: what claims leave alone

	gauge prometheus.GaugeFunc
}

// NewConnected reads the accounts tenant mappings have named with load
// (mappings.Accounts over the database) and asks Stripe about a stalled
// one with probe (Client.CheckAccess); nil probe never restores one.
func NewConnected(load func(context.Context) ([]string, error), probe func(ctx context.Context, account string) error, logger *slog.Logger) *Connected {
	if logger == nil {
		logger = slog.Default()
	}
	c := &Connected{load: load, probe: probe, logger: logger, known: map[string]bool{}, stalled: map[string]*AccountStall{}}
	c.gauge = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tally_export_stalled_accounts",
		Help: "Connected accounts (Stripe Connect) whose access Stripe refused to this node's key: their items wait, others export. The console's export page names them.",
	}, func() float64 {
		c.mu.Lock()
		defer c.mu.Unlock()
		return float64(len(c.stalled))
	})
	return c
}

// SetSource sets where Known reads the accounts tenant mappings have
// named (mappings.Accounts over the database). Until it is set, Known
// fails and the items of connected accounts are put back.
func (c *Connected) SetSource(load func(context.Context) ([]string, error)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.load = load
}

// errNoSource says Known has no source of accounts yet.
var errNoSource = errors.New("exporter: the connected accounts have no source yet")

// Collector is tally_export_stalled_accounts, to register.
func (c *Connected) Collector() prometheus.Collector { return c.gauge }

// Known reports whether a tenant mapping has ever named account. An
// account not known yet is looked up again first: a mapping saved a
// moment ago is not refused for a stale cache.
func (c *Connected) Known(ctx context.Context, account string) (bool, error) {
	c.mu.Lock()
	ok, load := c.known[account], c.load
	c.mu.Unlock()
	if ok {
		return true, nil
	}
	if load == nil {
		return false, errNoSource
	}
	accounts, err := load(ctx)
	if err != nil {
		return false, err
	}
	c.mu.Lock()
	first := len(c.known) == 0 && len(accounts) > 0
	for _, a := range accounts {
		c.known[a] = true
	}
	ok = c.known[account]
	onKnown := c.onKnown
	c.mu.Unlock()
	if first && onKnown != nil {
		onKnown()
	}
	return ok, nil
}

// Refused records that Stripe refused the key's access to account: claims
// skip its items until a probe or an accepted delivery says otherwise. It
// reports whether that is news.
func (c *Connected) Refused(account string, status int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if s, ok := c.stalled[account]; ok {
		s.Status = status
		return false
	}
	c.stalled[account] = &AccountStall{Account: account, Status: status, Since: time.Now()}
	c.resetSkip()
	return true
}

// Works records an accepted delivery to account (or a probe Stripe
// answered); it reports whether the account was stalled until now.
func (c *Connected) Works(account string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.stalled[account]; !ok {
		return false
	}
	delete(c.stalled, account)
	c.resetSkip()
	return true
}

// resetSkip rebuilds skip; c.mu is held.
func (c *Connected) resetSkip() {
	skip := make([]string, 0, len(c.stalled))
	for a := range c.stalled {
		skip = append(skip, a)
	}
	slices.Sort(skip)
	c.skip = skip
}

// Skip is the stalled accounts, sorted, for a claim to leave alone; nil
// when none is. The caller must not modify it.
func (c *Connected) Skip() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.skip) == 0 {
		return nil
	}
	return c.skip
}

// skipped is Skip on a nil-safe receiver: nil without Connect.
func (c *Connected) skipped() []string {
	if c == nil {
		return nil
	}
	return c.Skip()
}

// Stalled lists the stalled accounts, sorted, for the console.
func (c *Connected) Stalled() []AccountStall {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]AccountStall, 0, len(c.stalled))
	for _, s := range c.stalled {
		out = append(out, *s)
	}
	slices.SortFunc(out, func(a, b AccountStall) int { return strings.Compare(a.Account, b.Account) })
	return out
}

// ProbeOnce asks Stripe about every stalled account: one Stripe answers
// for is restored, one it still refuses stays stalled, and one it does not
// answer about stays stalled until the next probe.
func (c *Connected) ProbeOnce(ctx context.Context) {
	if c.probe == nil {
		return
	}
	for _, s := range c.Stalled() {
		err := c.probe(ctx, s.Account)
		c.mu.Lock()
		if cur, ok := c.stalled[s.Account]; ok {
			cur.Probed = time.Now()
		}
		c.mu.Unlock()
		switch {
		case err == nil:
			if c.Works(s.Account) {
				c.logger.Info("Stripe answers for the connected account again: its items export", "account", s.Account)
			}
		case stripeapi.AccessRefused(err):
			// Still refused.
		default:
			code, status, _ := stripeapi.Describe(err)
			c.logger.Warn("probing a stalled connected account failed; trying again", "account", s.Account, "code", code, "status", status)
		}
	}
}

// Run reads the accounts tenant mappings name, then probes the stalled
// accounts every AccountProbeEvery, and reads the accounts again, until
// ctx ends.
func (c *Connected) Run(ctx context.Context) {
	c.refresh(ctx)
	t := time.NewTicker(AccountProbeEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			c.ProbeOnce(ctx)
			c.refresh(ctx)
		}
	}
}

// refresh reads the accounts tenant mappings name (Known of an account no
// one has: nothing is cached for it).
func (c *Connected) refresh(ctx context.Context) {
	if _, err := c.Known(ctx, ""); err != nil && !errors.Is(err, errNoSource) && ctx.Err() == nil {
		c.logger.Warn("reading the connected accounts of the tenant mappings failed; trying again", "error", err)
	}
}

// Explain says, for the console, what a stalled account means.
func (s AccountStall) Explain() string {
	return fmt.Sprintf("Stripe refused this platform's access to %s (status %d): its items wait pending, without attempts, and export when a probe finds access restored.", s.Account, s.Status)
}
