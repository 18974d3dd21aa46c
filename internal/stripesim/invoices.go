package stripesim

import (
	"net/http"
	"regexp"
	"slices"
	"time"

	"github.com/go-chi/chi/v5"
)

// Statuses of an invoice: the simulator's invoices are drafts until they
// finalize, then open (it takes no payments).
const (
	InvoiceDraft = "draft"
	InvoiceOpen  = "open"
)

const (
	invoiceObjectName = "invoice"

	// billingReasonCycle: "A subscription advanced into a new period";
	// billingReasonUpdate: "A subscription was updated" (stripe-go
	// Invoice.BillingReason).
	billingReasonCycle  = "subscription_cycle"
	billingReasonUpdate = "subscription_update"

	// DefaultInvoiceGrace is how long a subscription's draft invoice waits
	// before it finalizes: "All invoices have a default finalization grace
	// period of 1 hour"
	// (docs.stripe.com/billing/subscriptions/usage-based/configure-grace-period).
	DefaultInvoiceGrace = time.Hour

	// embeddedLines is how many lines an invoice object embeds; the rest
	// are listed by GET /v1/invoices/{id}/lines.
	embeddedLines = 10
)

// invoice is an invoice as the simulator holds it: made by a
// subscription, draft until it finalizes, then open (the simulator takes
// no payments).
type invoice struct {
	id            string
	livemode      bool
	customer      string
	subscription  string
	subMetadata   map[string]string // the subscription's metadata when it was made
	currency      string
	billingReason string
	created       time.Time
	status        string
	autoAdvance   bool
	// finalizesAt is when the draft finalizes automatically, created plus
	// the grace period; it applies only while autoAdvance is true.
	finalizesAt time.Time
	finalizedAt time.Time
	number      string
	periodStart time.Time
	periodEnd   time.Time
	lines       []*invoiceLine
	metadata    map[string]string
}

// invoiceLine is one line of an invoice: one metered subscription item's
// usage over [start, end).
type invoiceLine struct {
	id       string
	item     string // the subscription item
	price    *price
	start    time.Time
	end      time.Time
	quantity int64
	amount   int64
	// description is Stripe's "<quantity> × <product name>", as its lines
	// read ("1 × CreaTuAplicación (at €60.38 / month)" in a delivered
	// event); set with the quantity.
	description string
}

func (inv *invoice) total() int64 {
	var t int64
	for _, l := range inv.lines {
		t += l.amount
	}
	return t
}

// invoiceJSON is the invoice object stripe-go's stripe.Invoice decodes, in
// API version 2025-03-31.basil's shape: the subscription is under
// parent.subscription_details.subscription.
type invoiceJSON struct {
	ID                       string    `json:"id"`
	Object                   string    `json:"object"`
	AccountCountry           string    `json:"account_country"`
	AccountName              *string   `json:"account_name"`
	AmountDue                int64     `json:"amount_due"`
	AmountOverpaid           int64     `json:"amount_overpaid"`
	AmountPaid               int64     `json:"amount_paid"`
	AmountRemaining          int64     `json:"amount_remaining"`
	AmountShipping           int64     `json:"amount_shipping"`
	Application              *string   `json:"application"`
	AttemptCount             int64     `json:"attempt_count"`
	Attempted                bool      `json:"attempted"`
	AutoAdvance              bool      `json:"auto_advance"`
	AutomaticallyFinalizesAt *int64    `json:"automatically_finalizes_at"`
	BillingReason            string    `json:"billing_reason"`
	CollectionMethod         string    `json:"collection_method"`
	Created                  int64     `json:"created"`
	Currency                 string    `json:"currency"`
	Customer                 string    `json:"customer"`
	CustomerEmail            *string   `json:"customer_email"`
	CustomerName             *string   `json:"customer_name"`
	CustomerPhone            *string   `json:"customer_phone"`
	CustomerTaxExempt        string    `json:"customer_tax_exempt"`
	CustomerTaxIDs           []string  `json:"customer_tax_ids"`
	DefaultPaymentMethod     *string   `json:"default_payment_method"`
	DefaultSource            *string   `json:"default_source"`
	DefaultTaxRates          []string  `json:"default_tax_rates"`
	Description              *string   `json:"description"`
	Discounts                []string  `json:"discounts"`
	DueDate                  *int64    `json:"due_date"`
	EffectiveAt              *int64    `json:"effective_at"`
	EndingBalance            *int64    `json:"ending_balance"`
	Footer                   *string   `json:"footer"`
	HostedInvoiceURL         *string   `json:"hosted_invoice_url"`
	InvoicePDF               *string   `json:"invoice_pdf"`
	LastFinalizationError    *struct{} `json:"last_finalization_error"`
	LatestRevision           *string   `json:"latest_revision"`
	Issuer                   struct {
		Type string `json:"type"`
	} `json:"issuer"`
	Lines              lineListJSON      `json:"lines"`
	Livemode           bool              `json:"livemode"`
	Metadata           map[string]string `json:"metadata"`
	NextPaymentAttempt *int64            `json:"next_payment_attempt"`
	Number             *string           `json:"number"`
	OnBehalfOf         *string           `json:"on_behalf_of"`
	Parent             struct {
		QuoteDetails        *struct{} `json:"quote_details"`
		SubscriptionDetails *struct {
			Metadata     map[string]string `json:"metadata"`
			Subscription string            `json:"subscription"`
		} `json:"subscription_details"`
		Type string `json:"type"`
	} `json:"parent"`
	PeriodEnd                    int64   `json:"period_end"`
	PeriodStart                  int64   `json:"period_start"`
	PostPaymentCreditNotesAmount int64   `json:"post_payment_credit_notes_amount"`
	PrePaymentCreditNotesAmount  int64   `json:"pre_payment_credit_notes_amount"`
	ReceiptNumber                *string `json:"receipt_number"`
	StartingBalance              int64   `json:"starting_balance"`
	StatementDescriptor          *string `json:"statement_descriptor"`
	Status                       string  `json:"status"`
	StatusTransitions            struct {
		FinalizedAt           *int64 `json:"finalized_at"`
		MarkedUncollectibleAt *int64 `json:"marked_uncollectible_at"`
		PaidAt                *int64 `json:"paid_at"`
		VoidedAt              *int64 `json:"voided_at"`
	} `json:"status_transitions"`
	Subtotal                 int64      `json:"subtotal"`
	SubtotalExcludingTax     int64      `json:"subtotal_excluding_tax"`
	TestClock                *string    `json:"test_clock"`
	Total                    int64      `json:"total"`
	TotalDiscountAmounts     []struct{} `json:"total_discount_amounts"`
	TotalExcludingTax        int64      `json:"total_excluding_tax"`
	TotalPretaxCreditAmounts []struct{} `json:"total_pretax_credit_amounts"`
	TotalTaxes               []struct{} `json:"total_taxes"`
	WebhooksDeliveredAt      *int64     `json:"webhooks_delivered_at"`
}

type lineListJSON struct {
	Object     string     `json:"object"`
	Data       []lineJSON `json:"data"`
	HasMore    bool       `json:"has_more"`
	TotalCount int        `json:"total_count"`
	URL        string     `json:"url"`
}

// lineJSON is the line_item object stripe-go's stripe.InvoiceLineItem
// decodes, in API version 2025-03-31.basil's shape: the price under
// pricing.price_details.price, the subscription item under
// parent.subscription_item_details.subscription_item.
type lineJSON struct {
	ID              string            `json:"id"`
	Object          string            `json:"object"`
	Amount          int64             `json:"amount"`
	Currency        string            `json:"currency"`
	Description     *string           `json:"description"`
	DiscountAmounts []struct{}        `json:"discount_amounts"`
	Discountable    bool              `json:"discountable"`
	Discounts       []string          `json:"discounts"`
	Invoice         string            `json:"invoice"`
	Livemode        bool              `json:"livemode"`
	Metadata        map[string]string `json:"metadata"`
	Parent          struct {
		InvoiceItemDetails      *struct{} `json:"invoice_item_details"`
		SubscriptionItemDetails struct {
			InvoiceItem      *string `json:"invoice_item"`
			Proration        bool    `json:"proration"`
			ProrationDetails struct {
				CreditedItems *struct{} `json:"credited_items"`
			} `json:"proration_details"`
			Subscription     string `json:"subscription"`
			SubscriptionItem string `json:"subscription_item"`
		} `json:"subscription_item_details"`
		Type string `json:"type"`
	} `json:"parent"`
	Period struct {
		End   int64 `json:"end"`
		Start int64 `json:"start"`
	} `json:"period"`
	PretaxCreditAmounts []struct{} `json:"pretax_credit_amounts"`
	Pricing             struct {
		PriceDetails struct {
			Price   string `json:"price"`
			Product string `json:"product"`
		} `json:"price_details"`
		Type              string  `json:"type"`
		UnitAmountDecimal *string `json:"unit_amount_decimal"`
	} `json:"pricing"`
	Quantity int64      `json:"quantity"`
	Taxes    []struct{} `json:"taxes"`
}

func (inv *invoice) lineJSON(l *invoiceLine) lineJSON {
	out := lineJSON{
		ID: l.id, Object: "line_item", Amount: l.amount, Currency: inv.currency,
		Description:     optional(l.description),
		DiscountAmounts: []struct{}{}, Discountable: true, Discounts: []string{}, Invoice: inv.id,
		Livemode: inv.livemode, Metadata: map[string]string{}, PretaxCreditAmounts: []struct{}{}, Quantity: l.quantity,
		Taxes: []struct{}{},
	}
	out.Parent.Type = "subscription_item_details"
	out.Parent.SubscriptionItemDetails.Subscription = inv.subscription
	out.Parent.SubscriptionItemDetails.SubscriptionItem = l.item
	out.Period.Start, out.Period.End = l.start.Unix(), l.end.Unix()
	out.Pricing.Type = "price_details"
	out.Pricing.PriceDetails.Price, out.Pricing.PriceDetails.Product = l.price.id, l.price.product
	if l.price.unit != nil {
		d := decimalString(l.price.unit)
		out.Pricing.UnitAmountDecimal = &d
	}
	return out
}

// json renders inv; cu is its customer, for the customer_* fields.
func (inv *invoice) json(cu *customer) invoiceJSON {
	total := inv.total()
	out := invoiceJSON{
		ID: inv.id, Object: "invoice", AccountCountry: "US", AmountDue: total, AmountRemaining: total,
		AutoAdvance: inv.autoAdvance, BillingReason: inv.billingReason, CollectionMethod: "charge_automatically",
		Created: inv.created.Unix(), Currency: inv.currency, Customer: inv.customer, CustomerTaxExempt: "none",
		CustomerTaxIDs: []string{}, DefaultTaxRates: []string{}, Discounts: []string{}, Livemode: inv.livemode,
		Metadata: cloneMetadata(inv.metadata), Number: optional(inv.number), PeriodEnd: inv.periodEnd.Unix(),
		PeriodStart: inv.periodStart.Unix(), Status: inv.status, Subtotal: total, SubtotalExcludingTax: total,
		Total: total, TotalDiscountAmounts: []struct{}{}, TotalExcludingTax: total,
		TotalPretaxCreditAmounts: []struct{}{}, TotalTaxes: []struct{}{},
	}
	if cu != nil {
		out.CustomerEmail, out.CustomerName, out.CustomerPhone = optional(cu.email), optional(cu.name), optional(cu.phone)
	}
	// "If the invoice is not in the draft state, this field will always
	// be null", and it is null when the invoice "is not scheduled to
	// finalize" (stripe-go Invoice.AutomaticallyFinalizesAt).
	if inv.status == InvoiceDraft && inv.autoAdvance {
		out.AutomaticallyFinalizesAt = unixOrNil(inv.finalizesAt)
	}
	if inv.status != InvoiceDraft {
		zero := int64(0)
		out.EffectiveAt, out.EndingBalance = unixOrNil(inv.finalizedAt), &zero
		out.StatusTransitions.FinalizedAt = unixOrNil(inv.finalizedAt)
	}
	out.Issuer.Type = "self"
	out.Parent.Type = "subscription_details"
	out.Parent.SubscriptionDetails = &struct {
		Metadata     map[string]string `json:"metadata"`
		Subscription string            `json:"subscription"`
	}{Metadata: cloneMetadata(inv.subMetadata), Subscription: inv.subscription}
	out.Lines = lineListJSON{Object: "list", Data: []lineJSON{}, HasMore: len(inv.lines) > embeddedLines,
		TotalCount: len(inv.lines), URL: "/v1/invoices/" + inv.id + "/lines"}
	for _, l := range inv.lines[:min(len(inv.lines), embeddedLines)] {
		out.Lines.Data = append(out.Lines.Data, inv.lineJSON(l))
	}
	return out
}

// invoiceJSONLocked renders inv with its customer. s.mu must be held.
func (a *account) invoiceJSONLocked(inv *invoice) invoiceJSON {
	return inv.json(a.customers[modeID{inv.livemode, inv.customer}])
}

// findInvoiceLocked returns the invoice id of a's mode, or nil.
func (a *account) findInvoiceLocked(livemode bool, id string) *invoice {
	for _, inv := range a.invoices {
		if inv.id == id && inv.livemode == livemode {
			return inv
		}
	}
	return nil
}

// getInvoice is GET /v1/invoices/{id}.
func (s *Server) getInvoice(w http.ResponseWriter, r *http.Request) {
	if e := checkParams(r.Form); e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	a := s.accountLocked(c.account)
	inv := a.findInvoiceLocked(c.livemode, id)
	var out invoiceJSON
	if inv != nil {
		out = a.invoiceJSONLocked(inv)
	}
	s.mu.Unlock()
	if inv == nil {
		writeError(w, errNoSuch(http.StatusNotFound, invoiceObjectName, "id", id))
		return
	}
	writeJSON(w, http.StatusOK, out)
}

var invoiceStatuses = []string{"draft", "open", "paid", "uncollectible", "void"}

// listInvoices is GET /v1/invoices: "sorted by creation date, with the
// most recently created invoices appearing first" (stripe-go
// InvoiceListParams), filtered by customer, subscription, status and
// created.
func (s *Server) listInvoices(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	keys := append([]*regexp.Regexp{exact("customer"), exact("subscription"), exact("status"), exact("collection_method")},
		append(slices.Clone(listKeys), createdKeys...)...)
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
	if st := f.Get("status"); f.Has("status") && !slices.Contains(invoiceStatuses, st) {
		writeError(w, errValidation("", "status", "Invalid status: must be one of %s", joinOr(invoiceStatuses)))
		return
	}
	keep := func(inv *invoice) bool {
		switch {
		case f.Has("customer") && inv.customer != f.Get("customer"),
			f.Has("subscription") && inv.subscription != f.Get("subscription"),
			f.Has("status") && inv.status != f.Get("status"),
			f.Has("collection_method") && f.Get("collection_method") != "charge_automatically",
			!created.keeps(inv.created):
			return false
		}
		return true
	}
	c := callerOf(r)
	s.mu.Lock()
	var all []*invoice
	a := s.accountLocked(c.account)
	for _, inv := range a.invoices {
		if inv.livemode == c.livemode {
			all = append(all, inv)
		}
	}
	// Newest first; invoices made in one processing share a created time
	// and keep their making order, reversed.
	slices.Reverse(all)
	slices.SortStableFunc(all, func(x, y *invoice) int { return y.created.Compare(x.created) })
	page, more, e := paginate(all, func(inv *invoice) string { return inv.id }, keep, lp, invoiceObjectName)
	out := make([]invoiceJSON, len(page))
	for i, inv := range page {
		out[i] = a.invoiceJSONLocked(inv)
	}
	s.mu.Unlock()
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, listEnvelope{Object: "list", Data: out, HasMore: more, URL: "/v1/invoices"})
}

// listInvoiceLines is GET /v1/invoices/{id}/lines: the lines in their
// order on the invoice.
func (s *Server) listInvoiceLines(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	if e := checkParamPatterns(f, listKeys...); e != nil {
		writeError(w, e)
		return
	}
	lp, e := parseListParams(f)
	if e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	inv := s.accountLocked(c.account).findInvoiceLocked(c.livemode, id)
	var out []lineJSON
	var more bool
	if inv != nil {
		var page []*invoiceLine
		page, more, e = paginate(inv.lines, func(l *invoiceLine) string { return l.id }, func(*invoiceLine) bool { return true },
			lp, "invoice line item")
		for _, l := range page {
			out = append(out, inv.lineJSON(l))
		}
	}
	s.mu.Unlock()
	switch {
	case inv == nil:
		writeError(w, errNoSuch(http.StatusNotFound, invoiceObjectName, "invoice", id))
	case e != nil:
		writeError(w, e)
	default:
		if out == nil {
			out = []lineJSON{}
		}
		writeJSON(w, http.StatusOK, listEnvelope{Object: "list", Data: out, HasMore: more, URL: "/v1/invoices/" + id + "/lines"})
	}
}

var invoiceUpdateKeys = []*regexp.Regexp{exact("auto_advance"), metadataKey}

// updateInvoice is POST /v1/invoices/{id}: auto_advance and metadata. "You
// can toggle the auto_advance property on draft and open invoices"
// (docs.stripe.com/invoicing/integration/automatic-advancement-collection);
// the simulator's invoices are never paid, void or uncollectible, so every
// one takes it. auto_advance=false holds a draft past its automatic
// finalization; true again puts it back on its schedule, created plus the
// grace period, so that a draft whose time has passed finalizes at the
// next processing (the worst plausible reading: Stripe says it "calculates
// and sets the time according to the configurable grace period",
// docs.stripe.com/invoicing/scheduled-finalization, without saying from
// when).
func (s *Server) updateInvoice(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	if e := checkParamPatterns(f, invoiceUpdateKeys...); e != nil {
		writeError(w, e)
		return
	}
	auto, e := boolParam(f, "auto_advance", false)
	if e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	s.mu.Lock()
	a := s.accountLocked(c.account)
	inv := a.findInvoiceLocked(c.livemode, id)
	var out invoiceJSON
	if inv != nil {
		before := snapshot(a.invoiceJSONLocked(inv))
		if f.Has("auto_advance") {
			inv.autoAdvance = auto
		}
		mergeMetadata(&inv.metadata, nestedMap(f, "metadata"))
		out = a.invoiceJSONLocked(inv)
		if prev := previousAttributes(before, snapshot(out)); prev != nil {
			s.emitLocked(a, EventInvoiceUpdated, inv.livemode, s.now(), out, prev, r)
		}
	}
	s.mu.Unlock()
	if inv == nil {
		writeError(w, errNoSuch(http.StatusNotFound, invoiceObjectName, "id", id))
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// finalizeInvoice is POST /v1/invoices/{id}/finalize: a draft finalizes
// now, its lines recomputed from the usage recorded so far. A finalized
// invoice is refused with Stripe's message, as reported by its users
// ("This invoice is already finalized, you can't re-finalize a non-draft
// invoice.").
func (s *Server) finalizeInvoice(w http.ResponseWriter, r *http.Request) {
	f := r.Form
	if e := checkParamPatterns(f, exact("auto_advance")); e != nil {
		writeError(w, e)
		return
	}
	auto, e := boolParam(f, "auto_advance", false)
	if e != nil {
		writeError(w, e)
		return
	}
	c, id := callerOf(r), chi.URLParam(r, "id")
	out, e := func() (invoiceJSON, *apiError) {
		s.mu.Lock()
		defer s.mu.Unlock()
		a := s.accountLocked(c.account)
		inv := a.findInvoiceLocked(c.livemode, id)
		switch {
		case inv == nil:
			return invoiceJSON{}, errNoSuch(http.StatusNotFound, invoiceObjectName, "id", id)
		case inv.status != InvoiceDraft:
			return invoiceJSON{}, errInvalid(http.StatusBadRequest, "", "",
				"This invoice is already finalized, you can't re-finalize a non-draft invoice.")
		}
		if f.Has("auto_advance") {
			inv.autoAdvance = auto
		}
		s.finalizeLocked(a, inv, s.now(), r)
		return a.invoiceJSONLocked(inv), nil
	}()
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, out)
}

// Invoice is an invoice as tests read it back.
type Invoice struct {
	ID            string
	Livemode      bool
	Customer      string
	Subscription  string
	Status        string // InvoiceDraft or InvoiceOpen
	BillingReason string
	AutoAdvance   bool
	Number        string // set when finalized
	Currency      string
	Created       time.Time
	// AutomaticallyFinalizesAt is when the draft finalizes by itself;
	// zero when it is not scheduled to (finalized, or auto_advance
	// false).
	AutomaticallyFinalizesAt time.Time
	FinalizedAt              time.Time
	PeriodStart, PeriodEnd   time.Time
	Total                    int64
	Lines                    []InvoiceLine
}

// InvoiceLine is one line of an [Invoice].
type InvoiceLine struct {
	ID                     string
	SubscriptionItem       string
	Price                  string
	Meter                  string
	PeriodStart, PeriodEnd time.Time
	Quantity               int64
	Amount                 int64
}

// Invoices returns the invoices of account, both modes, in the order they
// were made, after applying the billing due at the simulator's now
// ([Server.AdvanceBilling]).
func (s *Server) Invoices(account string) []Invoice {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.advanceBillingLocked(s.now())
	a := s.accounts[account]
	if a == nil {
		return nil
	}
	out := make([]Invoice, len(a.invoices))
	for i, inv := range a.invoices {
		o := Invoice{ID: inv.id, Livemode: inv.livemode, Customer: inv.customer, Subscription: inv.subscription,
			Status: inv.status, BillingReason: inv.billingReason, AutoAdvance: inv.autoAdvance, Number: inv.number,
			Currency: inv.currency, Created: inv.created, FinalizedAt: inv.finalizedAt, PeriodStart: inv.periodStart,
			PeriodEnd: inv.periodEnd, Total: inv.total()}
		if inv.status == InvoiceDraft && inv.autoAdvance {
			o.AutomaticallyFinalizesAt = inv.finalizesAt
		}
		for _, l := range inv.lines {
			o.Lines = append(o.Lines, InvoiceLine{ID: l.id, SubscriptionItem: l.item, Price: l.price.id,
				Meter: l.price.recurring.meter, PeriodStart: l.start, PeriodEnd: l.end, Quantity: l.quantity, Amount: l.amount})
		}
		out[i] = o
	}
	return out
}
