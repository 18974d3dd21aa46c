package stripesim

import (
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"time"

	"github.com/go-chi/chi/v5"
)

// Statuses of a subscription: the simulator's subscriptions are active
// until canceled (no trials, no payments to fail).
const (
	SubscriptionActive   = "active"
	SubscriptionCanceled = "canceled"
)

const (
	subscriptionObjectName = "subscription"
	itemObjectName         = "subscription item"

	// maxItems is how many items a subscription may have: "A list of up
	// to 20 subscription items" (stripe-go SubscriptionCreateParams.Items).
	maxItems = 20
)

// subscription is a subscription as the simulator holds it. Every item
// shares the subscription's billing cycle: the simulator runs classic
// billing mode, the default of API version 2025-08-27.basil (flexible
// became the default with 2025-09-30.clover), in which all prices of a
// subscription have one interval.
type subscription struct {
	id       string
	livemode bool
	created  time.Time
	start    time.Time // start_date: the creation, or backdate_start_date
	customer string
	currency string

	anchor   time.Time // billing_cycle_anchor
	interval string
	count    int64
	// periodStart is when the current period began; periodIndex the
	// billing date that ends it (billingDate(anchor, …, periodIndex)).
	periodStart time.Time
	periodIndex int64
	items       []*subItem

	status            string
	cancelAtPeriodEnd bool
	canceledAt        time.Time
	endedAt           time.Time
	cancelComment     string
	cancelFeedback    string
	cancelReason      string
	metadata          map[string]string
	latestInvoice     string
}

// subItem is one item of a subscription. Its usage is billed from
// periodStart, the later of the period's start and the time the item (or
// its price) was added: "if you add a new subscription item with price C
// on January 16. At the end of the month, the invoice includes usage from
// January 16 to January 31 at price C for that subscription item"
// (docs.stripe.com/billing/subscriptions/usage-based/manage-billing-setup).
type subItem struct {
	id          string
	created     time.Time
	price       *price
	periodStart time.Time
	metadata    map[string]string
}

// periodEnd is the end of the current billing period.
func (s *subscription) periodEnd() time.Time {
	return billingDate(s.anchor, s.interval, s.count, s.periodIndex)
}

// subscriptionJSON is the subscription object stripe-go's
// stripe.Subscription decodes, in API version 2025-03-31.basil's shape:
// the billing period is on each item, not on the subscription.
type subscriptionJSON struct {
	ID                    string   `json:"id"`
	Object                string   `json:"object"`
	Application           *string  `json:"application"`
	ApplicationFeePercent *float64 `json:"application_fee_percent"`
	AutomaticTax          struct {
		Enabled   bool      `json:"enabled"`
		Liability *struct{} `json:"liability"`
	} `json:"automatic_tax"`
	BillingCycleAnchor       int64     `json:"billing_cycle_anchor"`
	BillingCycleAnchorConfig *struct{} `json:"billing_cycle_anchor_config"`
	BillingMode              struct {
		Type string `json:"type"`
	} `json:"billing_mode"`
	BillingThresholds   *struct{} `json:"billing_thresholds"`
	CancelAt            *int64    `json:"cancel_at"`
	CancelAtPeriodEnd   bool      `json:"cancel_at_period_end"`
	CanceledAt          *int64    `json:"canceled_at"`
	CancellationDetails struct {
		Comment  *string `json:"comment"`
		Feedback *string `json:"feedback"`
		Reason   *string `json:"reason"`
	} `json:"cancellation_details"`
	CollectionMethod     string            `json:"collection_method"`
	Created              int64             `json:"created"`
	Currency             string            `json:"currency"`
	Customer             string            `json:"customer"`
	DaysUntilDue         *int64            `json:"days_until_due"`
	DefaultPaymentMethod *string           `json:"default_payment_method"`
	DefaultSource        *string           `json:"default_source"`
	DefaultTaxRates      []struct{}        `json:"default_tax_rates"`
	Description          *string           `json:"description"`
	Discounts            []string          `json:"discounts"`
	EndedAt              *int64            `json:"ended_at"`
	Items                itemListJSON      `json:"items"`
	LatestInvoice        *string           `json:"latest_invoice"`
	Livemode             bool              `json:"livemode"`
	Metadata             map[string]string `json:"metadata"`
	OnBehalfOf           *string           `json:"on_behalf_of"`
	PauseCollection      *struct{}         `json:"pause_collection"`
	PendingSetupIntent   *string           `json:"pending_setup_intent"`
	PendingUpdate        *struct{}         `json:"pending_update"`
	Schedule             *string           `json:"schedule"`
	StartDate            int64             `json:"start_date"`
	Status               string            `json:"status"`
	TestClock            *string           `json:"test_clock"`
	TransferData         *struct{}         `json:"transfer_data"`
	TrialEnd             *int64            `json:"trial_end"`
	TrialStart           *int64            `json:"trial_start"`
}

type itemListJSON struct {
	Object     string        `json:"object"`
	Data       []subItemJSON `json:"data"`
	HasMore    bool          `json:"has_more"`
	TotalCount int           `json:"total_count"`
	URL        string        `json:"url"`
}

// subItemJSON is the subscription_item object, the full price embedded.
// A metered item has no quantity, so none is rendered.
type subItemJSON struct {
	ID                 string            `json:"id"`
	Object             string            `json:"object"`
	BillingThresholds  *struct{}         `json:"billing_thresholds"`
	Created            int64             `json:"created"`
	CurrentPeriodEnd   int64             `json:"current_period_end"`
	CurrentPeriodStart int64             `json:"current_period_start"`
	Discounts          []string          `json:"discounts"`
	Metadata           map[string]string `json:"metadata"`
	Price              priceJSON         `json:"price"`
	Subscription       string            `json:"subscription"`
	TaxRates           []struct{}        `json:"tax_rates"`
}

func unixOrNil(t time.Time) *int64 {
	if t.IsZero() {
		return nil
	}
	u := t.Unix()
	return &u
}

func cloneMetadata(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return maps.Clone(m)
}

func (s *subscription) json(v priceView) subscriptionJSON {
	out := subscriptionJSON{
		ID: s.id, Object: "subscription", BillingCycleAnchor: s.anchor.Unix(), CancelAtPeriodEnd: s.cancelAtPeriodEnd,
		CanceledAt: unixOrNil(s.canceledAt), CollectionMethod: "charge_automatically", Created: s.created.Unix(),
		Currency: s.currency, Customer: s.customer, DefaultTaxRates: []struct{}{}, Discounts: []string{},
		EndedAt: unixOrNil(s.endedAt), LatestInvoice: optional(s.latestInvoice), Livemode: s.livemode,
		Metadata: cloneMetadata(s.metadata), StartDate: s.start.Unix(), Status: s.status,
	}
	out.BillingMode.Type = "classic"
	out.CancellationDetails.Comment = optional(s.cancelComment)
	out.CancellationDetails.Feedback = optional(s.cancelFeedback)
	out.CancellationDetails.Reason = optional(s.cancelReason)
	end := s.periodEnd().Unix()
	out.Items = itemListJSON{Object: "list", Data: []subItemJSON{}, TotalCount: len(s.items),
		URL: "/v1/subscription_items?subscription=" + s.id}
	for _, it := range s.items {
		out.Items.Data = append(out.Items.Data, subItemJSON{
			ID: it.id, Object: "subscription_item", Created: it.created.Unix(), CurrentPeriodEnd: end,
			CurrentPeriodStart: it.periodStart.Unix(), Discounts: []string{}, Metadata: cloneMetadata(it.metadata),
			Price: it.price.json(v), Subscription: s.id, TaxRates: []struct{}{},
		})
	}
	return out
}

// findSubscriptionLocked returns the subscription id of a's mode, or nil.
func (a *account) findSubscriptionLocked(livemode bool, id string) *subscription {
	for _, s := range a.subs {
		if s.id == id && s.livemode == livemode {
			return s
		}
	}
	return nil
}

var (
	itemPriceKey    = regexp.MustCompile(`^items\[[0-9]+\]\[(price|quantity)\]$`)
	itemMetadataKey = regexp.MustCompile(`^items\[[0-9]+\]\[metadata\]\[[^\]]+\]$`)

	subscriptionCreateKeys = []*regexp.Regexp{exact("customer"), itemPriceKey, itemMetadataKey,
		exact("billing_cycle_anchor"), exact("backdate_start_date"), metadataKey, exact("cancel_at_period_end"),
		exact("proration_behavior")}
	subscriptionUpdateKeys = []*regexp.Regexp{itemPriceKey, itemMetadataKey,
		regexp.MustCompile(`^items\[[0-9]+\]\[(id|deleted|clear_usage)\]$`), metadataKey,
		exact("cancel_at_period_end"), exact("proration_behavior"),
		exact("cancellation_details[comment]"), exact("cancellation_details[feedback]")}
	subscriptionCancelKeys = []*regexp.Regexp{exact("invoice_now"), exact("prorate"),
		exact("cancellation_details[comment]"), exact("cancellation_details[feedback]")}
	itemDeleteKeys = []*regexp.Regexp{exact("clear_usage"), exact("proration_behavior"), exact("proration_date")}
)

// canceledKeys are the keys, beside metadata, an update of a canceled
// subscription may send.
var canceledKeys = regexp.MustCompile(`^(expand$|expand\[|cancellation_details\[)`)

var prorationBehaviors = []string{"create_prorations", "none", "always_invoice"}

// itemInput is one items[n] entry of a create or update.
type itemInput struct {
	param    string // "items[n]"
	id       string
	price    string
	deleted  bool
	quantity bool // a quantity was sent
	metadata map[string]string
}

// parseItems reads the items[n] entries of a create or update.
func parseItems(f url.Values) ([]itemInput, *apiError) {
	entries, e := indexedParams(f, "items")
	if e != nil {
		return nil, e
	}
	out := make([]itemInput, 0, len(entries))
	for _, en := range entries {
		in := itemInput{param: fmt.Sprintf("items[%d]", en.index), id: en.fields.Get("id"), price: en.fields.Get("price"),
			quantity: en.fields.Has("quantity"), metadata: nestedMap(en.fields, "metadata")}
		if in.deleted, e = boolParam(en.fields, "deleted", false); e != nil {
			e.Param = in.param + "[deleted]"
			return nil, e
		}
		if in.id == "" && in.price == "" {
			return nil, errMissingParam(in.param + "[price]")
		}
		if in.deleted && in.id == "" {
			return nil, errMissingParam(in.param + "[id]")
		}
		out = append(out, in)
	}
	return out, nil
}

// subscriptionPriceLocked returns the price an item may subscribe to, or
// the error Stripe answers (a price of another mode or account is
// unknown). s.mu must be held.
func (a *account) subscriptionPriceLocked(livemode bool, param, id string) (*price, *apiError) {
	p := a.findPriceLocked(livemode, id)
	switch {
	case p == nil:
		return nil, errNoSuch(http.StatusBadRequest, priceObjectName, param, id)
	case !p.active:
		return nil, errInvalid(http.StatusBadRequest, "", param,
			"The price specified is inactive. This field only accepts active prices.")
	case p.recurring == nil:
		return nil, errInvalid(http.StatusBadRequest, "", param,
			"The price specified is set to `type=one_time` but this field only accepts prices with `type=recurring`.")
	case !p.metered():
		// A simulator limit, not Stripe's: licensed prices are billed in
		// advance with prorations, which the simulator does not model.
		return nil, errInvalid(http.StatusBadRequest, "", param,
			"stripesim: only metered prices can be subscribed to; licensed prices are not simulated.")
	}
	return p, nil
}

// checkItemSet checks the prices a subscription would have: at least one,
// at most 20, one currency and interval, no price twice.
func checkItemSet(prices []*price) *apiError {
	if len(prices) == 0 {
		return errInvalid(http.StatusBadRequest, "", "items",
			"A subscription must have at least one active plan. To cancel a subscription, please use the cancel API endpoint on /v1/subscriptions.")
	}
	if len(prices) > maxItems {
		return errInvalid(http.StatusBadRequest, "", "items", "A subscription can have at most %d items.", maxItems)
	}
	first := prices[0]
	seen := map[string]bool{}
	for _, p := range prices {
		if p.currency != first.currency || p.recurring.interval != first.recurring.interval || p.recurring.count != first.recurring.count {
			field := "interval"
			if p.currency != first.currency {
				field = "currency"
			}
			// Stripe's message, as its users report it.
			return errInvalid(http.StatusBadRequest, "", "items",
				"Currency and interval fields must match across all plans on this subscription. Found mismatch in %s field.", field)
		}
		if seen[p.id] {
			return errInvalid(http.StatusBadRequest, "", "items",
				"Cannot add multiple subscription items with the same price: %s", p.id)
		}
		seen[p.id] = true
	}
	return nil
}

// subscriptionInput is a POST /v1/subscriptions whose shape is valid.
type subscriptionInput struct {
	livemode          bool
	customer          string
	items             []itemInput
	anchor, backdate  time.Time // zero: not sent
	cancelAtPeriodEnd bool
	metadata          map[string]string
}

// parseSubscription reads the shape of a POST /v1/subscriptions at now.
func parseSubscription(f url.Values, livemode bool, now time.Time) (subscriptionInput, *apiError) {
	in := subscriptionInput{livemode: livemode, customer: f.Get("customer"), metadata: nestedMap(f, "metadata")}
	if e := checkParamPatterns(f, subscriptionCreateKeys...); e != nil {
		return in, e
	}
	if in.customer == "" {
		return in, errMissingParam("customer")
	}
	var e *apiError
	if in.items, e = parseItems(f); e != nil {
		return in, e
	}
	if len(in.items) == 0 {
		return in, errMissingParam("items")
	}
	if pb := f.Get("proration_behavior"); f.Has("proration_behavior") && !slices.Contains(prorationBehaviors, pb) {
		return in, errValidation("", "proration_behavior", "Invalid proration_behavior: must be one of create_prorations, none, or always_invoice")
	}
	if in.cancelAtPeriodEnd, e = boolParam(f, "cancel_at_period_end", false); e != nil {
		return in, e
	}
	if n, has, e := optionalInt(f, "backdate_start_date"); e != nil {
		return in, e
	} else if has {
		in.backdate = time.Unix(n, 0).UTC()
		if in.backdate.After(now) {
			return in, errValidation("", "backdate_start_date", "Invalid backdate_start_date: must be a timestamp in the past.")
		}
	}
	if n, has, e := optionalInt(f, "billing_cycle_anchor"); e != nil {
		return in, e
	} else if has {
		in.anchor = time.Unix(n, 0).UTC()
		if in.anchor.Before(now.Truncate(time.Second)) {
			return in, errValidation("", "billing_cycle_anchor", "Invalid billing_cycle_anchor: must be a timestamp in the future.")
		}
	}
	return in, nil
}

// addSubscriptionLocked checks in against account a at now and adds the
// subscription: the customer, each price, the billing cycle anchor no
// later than the next natural billing date. s.mu must be held.
func (s *Server) addSubscriptionLocked(a *account, in subscriptionInput, now time.Time, cause *http.Request) (*subscription, *apiError) {
	now = now.Truncate(time.Second) // Stripe's times are whole seconds; so are its periods
	if cu := a.customers[modeID{in.livemode, in.customer}]; cu == nil || cu.deleted {
		return nil, errNoSuch(http.StatusBadRequest, customerObjectName, "customer", in.customer)
	}
	prices := make([]*price, 0, len(in.items))
	for _, it := range in.items {
		if it.id != "" || it.deleted {
			return nil, errUnknownParam(it.param + "[id]")
		}
		p, e := a.subscriptionPriceLocked(in.livemode, it.param+"[price]", it.price)
		if e != nil {
			return nil, e
		}
		if it.quantity {
			// Stripe's message, as its users report it.
			return nil, errInvalid(http.StatusBadRequest, "", it.param+"[quantity]", "You cannot set the quantity for metered plans.")
		}
		prices = append(prices, p)
	}
	if e := checkItemSet(prices); e != nil {
		return nil, e
	}
	rec := prices[0].recurring
	sub := &subscription{
		id: randomID("sub_", 24), livemode: in.livemode, created: now, start: now, customer: in.customer,
		currency: prices[0].currency, anchor: now, interval: rec.interval, count: rec.count,
		status: SubscriptionActive, cancelAtPeriodEnd: in.cancelAtPeriodEnd, metadata: in.metadata,
	}
	if !in.backdate.IsZero() {
		sub.start = in.backdate
	}
	if !in.anchor.IsZero() {
		// "The anchor must be a future UNIX timestamp before the next
		// natural subscription billing date"
		// (docs.stripe.com/payments/checkout/billing-cycle).
		natural := billingDate(now, rec.interval, rec.count, 1)
		if in.anchor.After(natural) {
			return nil, errInvalid(http.StatusBadRequest, "", "billing_cycle_anchor",
				"billing_cycle_anchor cannot be later than next natural billing date (%d) for plan", natural.Unix())
		}
		sub.anchor = in.anchor
	}
	sub.periodStart = sub.start
	sub.periodIndex = firstBillingIndex(sub.anchor, sub.interval, sub.count, now)
	for i, p := range prices {
		sub.items = append(sub.items, &subItem{id: randomID("si_", 14), created: now, price: p,
			periodStart: sub.start, metadata: in.items[i].metadata})
	}
	a.subs = append(a.subs, sub)
	s.emitLocked(a, EventSubscriptionCreated, sub.livemode, now, sub.json(priceView{}), nil, cause)
	return sub, nil
}

// createSubscription is POST /v1/subscriptions.
func (s *Server) createSubscription(w http.ResponseWriter, r *http.Request) {
	c := callerOf(r)
	now := s.now()
	in, e := parseSubscription(r.Form, c.livemode, now)
	if e != nil {
		writeError(w, e)
		return
	}
	s.mu.Lock()
	sub, e := s.addSubscriptionLocked(s.accountLocked(c.account), in, now, r)
	var out subscriptionJSON
	if sub != nil {
		out = sub.json(viewOf(r.Form))
	}
	s.mu.Unlock()
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// getSubscription is GET /v1/subscriptions/{id}.
func (s *Server) getSubscription(w http.ResponseWriter, r *http.Request) {
	if e := checkParams(r.Form); e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	sub := s.accountLocked(c.account).findSubscriptionLocked(c.livemode, id)
	var out subscriptionJSON
	if sub != nil {
		out = sub.json(viewOf(r.Form))
	}
	s.mu.Unlock()
	if sub == nil {
		writeError(w, errNoSuch(http.StatusNotFound, subscriptionObjectName, "id", id))
		return
	}
	writeJSON(w, http.StatusOK, out)
}

var subscriptionStatuses = []string{"active", "past_due", "unpaid", "canceled", "incomplete", "incomplete_expired",
	"trialing", "paused", "all", "ended"}

// listSubscriptions is GET /v1/subscriptions: newest first, filtered by
// customer, price, status and created. "If no value is supplied, all
// subscriptions that have not been canceled are returned"; status=all
// returns every status, ended the canceled ones (stripe-go
// SubscriptionListParams.Status).
func (s *Server) listSubscriptions(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	keys := append([]*regexp.Regexp{exact("customer"), exact("price"), exact("status")}, append(slices.Clone(listKeys), createdKeys...)...)
	if e := checkParamPatterns(f, keys...); e != nil {
		writeError(w, e)
		return
	}
	lp, e := parseListParams(f)
	if e != nil {
		writeError(w, e)
		return
	}
	created, e := parseCreatedFilter(f, "created")
	if e != nil {
		writeError(w, e)
		return
	}
	status := f.Get("status")
	if status != "" && !slices.Contains(subscriptionStatuses, status) {
		writeError(w, errValidation("", "status", "Invalid status: must be one of %s", joinOr(subscriptionStatuses)))
		return
	}
	keep := func(sub *subscription) bool {
		switch {
		case f.Has("customer") && sub.customer != f.Get("customer"),
			f.Has("price") && !slices.ContainsFunc(sub.items, func(it *subItem) bool { return it.price.id == f.Get("price") }),
			!created.keeps(sub.created):
			return false
		}
		switch status {
		case "":
			return sub.status != SubscriptionCanceled
		case "all":
			return true
		case "ended":
			return sub.status == SubscriptionCanceled
		}
		return sub.status == status
	}
	c, view := callerOf(r), viewOf(f)
	s.mu.Lock()
	var all []*subscription
	if a := s.accounts[c.account]; a != nil {
		for i := len(a.subs) - 1; i >= 0; i-- {
			if a.subs[i].livemode == c.livemode {
				all = append(all, a.subs[i])
			}
		}
	}
	page, more, e := paginate(all, func(sub *subscription) string { return sub.id }, keep, lp, subscriptionObjectName)
	out := make([]subscriptionJSON, len(page))
	for i, sub := range page {
		out[i] = sub.json(view)
	}
	s.mu.Unlock()
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, listEnvelope{Object: "list", Data: out, HasMore: more, URL: "/v1/subscriptions"})
}

// joinOr lists values as "a, b, or c".
func joinOr(values []string) string {
	out := ""
	for i, v := range values {
		switch {
		case i == 0:
		case i == len(values)-1:
			out += ", or "
		default:
			out += ", "
		}
		out += v
	}
	return out
}

// errCanceledUpdate is Stripe's answer to an update of a canceled
// subscription, as its users report it.
func errCanceledUpdate() *apiError {
	return errInvalid(http.StatusBadRequest, "", "", "A canceled subscription can only update its cancellation_details and metadata.")
}

// updateSubscription is POST /v1/subscriptions/{id}: items[n][id] with
// [deleted]=true removes an item (its usage since the period began is
// billed by no invoice, as in classic billing mode: "After deletion, the
// invoice doesn't reflect any usage from that item", manage-billing-setup);
// items[n][id] with [price] switches the item's price, billing only the
// usage after the switch; items[n][price] alone adds an item billed from
// now; cancel_at_period_end and metadata are set. A canceled subscription
// takes only metadata and cancellation_details.
func (s *Server) updateSubscription(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	if e := checkParamPatterns(f, subscriptionUpdateKeys...); e != nil {
		writeError(w, e)
		return
	}
	items, e := parseItems(f)
	if e != nil {
		writeError(w, e)
		return
	}
	cape, e := boolParam(f, "cancel_at_period_end", false)
	if e != nil {
		writeError(w, e)
		return
	}
	if pb := f.Get("proration_behavior"); f.Has("proration_behavior") && !slices.Contains(prorationBehaviors, pb) {
		writeError(w, errValidation("", "proration_behavior", "Invalid proration_behavior: must be one of create_prorations, none, or always_invoice"))
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	out, e := func() (subscriptionJSON, *apiError) {
		s.mu.Lock()
		defer s.mu.Unlock()
		a := s.accountLocked(c.account)
		sub := a.findSubscriptionLocked(c.livemode, id)
		if sub == nil {
			return subscriptionJSON{}, errNoSuch(http.StatusNotFound, subscriptionObjectName, "id", id)
		}
		if sub.status == SubscriptionCanceled {
			for k := range f {
				if !metadataKey.MatchString(k) && !canceledKeys.MatchString(k) {
					return subscriptionJSON{}, errCanceledUpdate()
				}
			}
		}
		now := s.now()
		next, e := s.nextItemsLocked(a, sub, items, now)
		if e != nil {
			return subscriptionJSON{}, e
		}
		before := snapshot(sub.json(priceView{}))
		sub.items = next
		if f.Has("cancel_at_period_end") && sub.status != SubscriptionCanceled {
			sub.cancelAtPeriodEnd = cape
			if cape {
				// "canceled_at will reflect the time of the most recent
				// update request" (stripe-go Subscription.CanceledAt).
				sub.canceledAt = now
			} else {
				sub.canceledAt = time.Time{}
			}
		}
		mergeMetadata(&sub.metadata, nestedMap(f, "metadata"))
		if f.Has("cancellation_details[comment]") {
			sub.cancelComment = f.Get("cancellation_details[comment]")
		}
		if f.Has("cancellation_details[feedback]") {
			sub.cancelFeedback = f.Get("cancellation_details[feedback]")
		}
		after := sub.json(priceView{})
		if prev := previousAttributes(before, snapshot(after)); prev != nil {
			s.emitLocked(a, EventSubscriptionUpdated, sub.livemode, now, after, prev, r)
		}
		return sub.json(viewOf(f)), nil
	}()
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// nextItemsLocked applies the items[n] entries of an update to sub's
// items at now and returns the new list, or the error Stripe answers.
// s.mu must be held.
func (s *Server) nextItemsLocked(a *account, sub *subscription, items []itemInput, now time.Time) ([]*subItem, *apiError) {
	if len(items) == 0 {
		return sub.items, nil
	}
	if sub.status == SubscriptionCanceled {
		return nil, errCanceledUpdate()
	}
	now = now.Truncate(time.Second) // an item's period starts on a whole second
	next := make([]*subItem, 0, len(sub.items))
	for _, it := range sub.items {
		cp := *it
		next = append(next, &cp)
	}
	for _, in := range items {
		var p *price
		if in.price != "" && !in.deleted {
			var e *apiError
			if p, e = a.subscriptionPriceLocked(sub.livemode, in.param+"[price]", in.price); e != nil {
				return nil, e
			}
			if in.quantity {
				return nil, errInvalid(http.StatusBadRequest, "", in.param+"[quantity]", "You cannot set the quantity for metered plans.")
			}
		}
		if in.id == "" {
			next = append(next, &subItem{id: randomID("si_", 14), created: now, price: p, periodStart: now, metadata: in.metadata})
			continue
		}
		i := slices.IndexFunc(next, func(it *subItem) bool { return it.id == in.id })
		if i < 0 {
			return nil, errNoSuch(http.StatusBadRequest, itemObjectName, in.param+"[id]", in.id)
		}
		if in.deleted {
			next = slices.Delete(next, i, i+1)
			continue
		}
		if p != nil && p != next[i].price {
			// "On future invoices, we reflect only usage that occurs
			// after the update" (manage-billing-setup, classic mode).
			next[i].price, next[i].periodStart = p, now
		}
		mergeMetadata(&next[i].metadata, in.metadata)
	}
	prices := make([]*price, len(next))
	for i, it := range next {
		prices[i] = it.price
	}
	if e := checkItemSet(prices); e != nil {
		return nil, e
	}
	if p := prices[0]; p.currency != sub.currency || p.recurring.interval != sub.interval || p.recurring.count != sub.count {
		return nil, errInvalid(http.StatusBadRequest, "", "items",
			"Currency and interval fields must match across all plans on this subscription. Found mismatch in interval field.")
	}
	return next, nil
}

// mergeMetadata sets the keys of update in *m; an empty value unsets its
// key, as Stripe's metadata parameters do.
func mergeMetadata(m *map[string]string, update map[string]string) {
	if len(update) == 0 {
		return
	}
	if *m == nil {
		*m = map[string]string{}
	}
	for k, v := range update {
		if v == "" {
			delete(*m, k)
		} else {
			(*m)[k] = v
		}
	}
}

// cancelSubscription is DELETE /v1/subscriptions/{id}: the subscription is
// canceled at once. Its metered usage since the current period began is
// billed only with invoice_now=true, which "Will generate a final invoice
// that invoices for any un-invoiced metered usage" (stripe-go
// SubscriptionCancelParams.InvoiceNow, default false); without it the
// usage is billed by no invoice. prorate credits unused time of licensed
// prices, which the simulator does not have: it is taken and changes
// nothing. "By default, upon subscription cancellation, Stripe stops
// automatic collection of all finalized invoices for the customer" (Cancel
// a subscription): the customer's open invoices get auto_advance=false. A
// subscription already canceled answers 404 resource_missing, as Stripe
// answers cancelling it again (a Stripe engineer, on stripe-go's tracker).
func (s *Server) cancelSubscription(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	if e := checkParamPatterns(f, subscriptionCancelKeys...); e != nil {
		writeError(w, e)
		return
	}
	invoiceNow, e := boolParam(f, "invoice_now", false)
	if e != nil {
		writeError(w, e)
		return
	}
	if _, e = boolParam(f, "prorate", false); e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	out, e := func() (subscriptionJSON, *apiError) {
		s.mu.Lock()
		defer s.mu.Unlock()
		a := s.accountLocked(c.account)
		sub := a.findSubscriptionLocked(c.livemode, id)
		if sub == nil || sub.status == SubscriptionCanceled {
			return subscriptionJSON{}, errNoSuch(http.StatusNotFound, subscriptionObjectName, "id", id)
		}
		// The period ends on a whole second; the final invoice sees the
		// usage received until now.
		now := s.now()
		end := now.Truncate(time.Second)
		if invoiceNow {
			s.openInvoiceLocked(a, sub, billingReasonUpdate, end, now, r)
		}
		sub.status, sub.canceledAt, sub.endedAt, sub.cancelReason = SubscriptionCanceled, end, end, "cancellation_requested"
		sub.cancelComment, sub.cancelFeedback = f.Get("cancellation_details[comment]"), f.Get("cancellation_details[feedback]")
		s.stopCollectionLocked(a, sub, now, r)
		s.emitLocked(a, EventSubscriptionDeleted, sub.livemode, now, sub.json(priceView{}), nil, r)
		return sub.json(viewOf(f)), nil
	}()
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// deletedItemJSON is a deleted subscription item as Stripe answers it.
type deletedItemJSON struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Deleted bool   `json:"deleted"`
}

// deleteSubscriptionItem is DELETE /v1/subscription_items/{id}: "Removing
// a subscription item from a subscription will not cancel the
// subscription" (stripe-go SubscriptionItemDeleteParams); its usage of the
// current period is billed by no invoice (classic billing mode), and the
// last item cannot be removed. clear_usage, proration_behavior and
// proration_date are taken and change nothing for metered prices.
func (s *Server) deleteSubscriptionItem(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	if e := checkParamPatterns(f, itemDeleteKeys...); e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	e := func() *apiError {
		s.mu.Lock()
		defer s.mu.Unlock()
		a := s.accountLocked(c.account)
		for _, sub := range a.subs {
			i := slices.IndexFunc(sub.items, func(it *subItem) bool { return it.id == id })
			if sub.livemode != c.livemode || i < 0 {
				continue
			}
			if sub.status == SubscriptionCanceled {
				return errCanceledUpdate()
			}
			next, e := s.nextItemsLocked(a, sub, []itemInput{{param: "id", id: id, deleted: true}}, s.now())
			if e != nil {
				return e
			}
			before := snapshot(sub.json(priceView{}))
			sub.items = next
			after := sub.json(priceView{})
			s.emitLocked(a, EventSubscriptionUpdated, sub.livemode, s.now(), after, previousAttributes(before, snapshot(after)), r)
			return nil
		}
		return errNoSuch(http.StatusNotFound, itemObjectName, "id", id)
	}()
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, deletedItemJSON{ID: id, Object: "subscription_item", Deleted: true})
}

// SubscriptionSpec describes a subscription to create with
// [Server.CreateSubscription].
type SubscriptionSpec struct {
	Livemode bool
	Customer string   // required
	Prices   []string // required: metered price ids, one item each
	// BillingCycleAnchor and BackdateStartDate are sent when not zero.
	BillingCycleAnchor time.Time
	BackdateStartDate  time.Time
	Metadata           map[string]string
}

// CreateSubscription adds a subscription to account (added if unknown)
// without HTTP, for test setup, validated as POST /v1/subscriptions would.
// It returns the subscription id and panics when the API would refuse it.
func (s *Server) CreateSubscription(account string, spec SubscriptionSpec) string {
	f := url.Values{}
	f.Set("customer", spec.Customer)
	for i, p := range spec.Prices {
		f.Set(fmt.Sprintf("items[%d][price]", i), p)
	}
	if !spec.BillingCycleAnchor.IsZero() {
		f.Set("billing_cycle_anchor", strconv.FormatInt(spec.BillingCycleAnchor.Unix(), 10))
	}
	if !spec.BackdateStartDate.IsZero() {
		f.Set("backdate_start_date", strconv.FormatInt(spec.BackdateStartDate.Unix(), 10))
	}
	for k, v := range spec.Metadata {
		f.Set("metadata["+k+"]", v)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	s.advanceBillingLocked(now)
	in, e := parseSubscription(f, spec.Livemode, now)
	if e == nil {
		var sub *subscription
		if sub, e = s.addSubscriptionLocked(s.accountLocked(account), in, now, nil); e == nil {
			return sub.id
		}
	}
	panic("stripesim: CreateSubscription: " + e.Message)
}
