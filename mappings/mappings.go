package mappings

import (
	"github.com/tallymeter/tally/internal/errcode"
)

// Store reads and writes mappings.
type Store struct {
	// Checker, when set, is asked before a mapping is written: a feature's
	// meter (which gives the mapping its payload keys) and a tenant's
	// customer. Unset (no Stripe key), mappings are saved unchecked, with
	// Warning's words and a note in their audit entry; a feature mapping
	// that names the same meter keeps the keys read before, and one that
	// names another takes Stripe's defaults; `tally doctor` checks them
	// against Stripe once a key is configured.
	Checker Checker
	// RestrictedKey says the node's Stripe key is a restricted key (rk_…).
	// Stripe's v2 API takes only secret keys ("You can only access APIs in
	// the /v2 namespace with secret keys", https://docs.stripe.com/api-v2-overview),
	// so a feature mapping that names ExporterStripeMeterEventStream is
	// refused: none of its items could be sent. The wiring sets it from
	// STRIPE_API_KEY (config.RestrictedKey).
	RestrictedKey bool
	// Subscriptions, when set, reads a tenant's customer's subscriptions
	// when its mapping is saved: the tenant bills by their periods.
	Subscriptions SubscriptionLister
}

// ErrNotFound says there is no mapping by that name.
var ErrNotFound = errcode.New(errcode.NotFound, "", "mappings: no such mapping")
