package mappings

import (
	"context"
	"fmt"

	"github.com/tallymeter/tally/internal/stripeapi"
)

// StripeMeters is the Checker of a Stripe account: feature mappings
// against its meters, tenant mappings against its customers, or those of
// the connected account a tenant mapping names (Stripe Connect: the same
// key, with Stripe-Account). The client's account (its Stripe-Account,
// else the key's own) is the account the node exports to.
type StripeMeters struct {
	Client *stripeapi.Client
}

// ErrProviderUnavailable says the provider's meters or customers could not
// be read.
type ErrProviderUnavailable struct {
	Code   string
	Status int
}

func (e *ErrProviderUnavailable) Error() string {
	return fmt.Sprintf("mappings: Stripe could not be asked (%s, status %d)", e.Code, e.Status)
}

// CheckCustomer implements CustomerChecker: the account — the connected
// account account when one is named, else the one the node exports to —
// must have the customer, not deleted. Meter events for a customer the
// account does not have are refused (meter_event_customer_not_found), and
// the items would wait in quarantine.
func (s StripeMeters) CheckCustomer(ctx context.Context, account, customerID string) error {
	_, err := s.CustomerName(ctx, account, customerID)
	return err
}

// CustomerName implements CustomerNamer: CheckCustomer, with the name
// Stripe holds for the customer ("" when it has none).
func (s StripeMeters) CustomerName(ctx context.Context, account, customerID string) (string, error) {
	c, err := s.Client.For(account)
	if err != nil {
		return "", accountUnreachable(account)
	}
	cu, err := c.CustomerOf(ctx, customerID)
	if err != nil {
		// account_invalid: the key may not act for the account. A 401 or
		// 403 without it is the key's own (a restricted key without
		// customers (read), say), as for the node's account.
		if account != "" && stripeapi.InvalidAccount(err) {
			return "", accountUnreachable(account)
		}
		code, status, _ := stripeapi.Describe(err)
		return "", &ErrProviderUnavailable{Code: code, Status: status}
	}
	where, check := "the account this node exports to", "check the id, the key's mode and STRIPE_ACCOUNT"
	if account != "" {
		where, check = "Stripe account "+account+" (the tenant mapping's stripe_account)", "check the id, the key's mode and the account"
	}
	switch cu.State {
	case stripeapi.CustomerActive:
		return cu.Name, nil
	case stripeapi.CustomerDeleted:
		return "", &CustomerError{Code: CodeCustomerDeleted,
			Message: fmt.Sprintf("Stripe's customer %s is deleted in %s; map a current customer", customerID, where)}
	}
	return "", &CustomerError{Code: CodeCustomerNotFound,
		Message: fmt.Sprintf("Stripe has no customer %s in %s (%s); create it there first", customerID, where, check)}
}

// CheckAccount implements AccountChecker: the platform's key must be able
// to act for account (GET /v1/account with Stripe-Account: account). A
// key that may not — the account is not connected to the platform, or
// its owner revoked the platform's access — is answered account_invalid
// (docs/stripe.md), or refused outright (401, 403): meter events for
// the account would be refused the same way, and its items would stall.
func (s StripeMeters) CheckAccount(ctx context.Context, account string) error {
	err := s.Client.CheckAccess(ctx, account)
	if err == nil {
		return nil
	}
	if stripeapi.AccessRefused(err) {
		return accountUnreachable(account)
	}
	code, status, _ := stripeapi.Describe(err)
	if code == stripeapi.CodeInvalidConfig { // not an account id: validation rules it out first
		return accountUnreachable(account)
	}
	return &ErrProviderUnavailable{Code: code, Status: status}
}

// accountUnreachable is the refusal of a connected account the platform's
// key may not act for.
func accountUnreachable(account string) *AccountError {
	return &AccountError{Code: CodeAccountUnreachable, Account: account,
		Message: fmt.Sprintf("the platform's key may not act for Stripe account %s (not connected, or access revoked); connect it first or leave stripe_account empty", account)}
}

// CheckMeter implements MeterChecker: an active meter must have the event
// name, its formula must be the aggregation, and it must take every event
// (no event_time_window). It returns the meter's payload keys, Stripe's
// default for a key the meter leaves empty.
//
// A pre-aggregated meter (event_time_window hour or day) keeps only the
// latest event of each customer and window, "a newer event overwrites the
// previous one" (docs.stripe.com/billing/subscriptions/usage-based/meters/configure,
// "Event ingestion"): a window's supplement, a correction or a second
// per-event item in the window would replace what Tally sent before it,
// and usage would be lost at Stripe. Tally sends to raw meters only.
func (s StripeMeters) CheckMeter(ctx context.Context, eventName string, aggregation Aggregation) (PayloadKeys, error) {
	m, ok, err := s.Client.MeterByEventName(ctx, eventName)
	if err != nil {
		code, status, _ := stripeapi.Describe(err)
		return PayloadKeys{}, &ErrProviderUnavailable{Code: code, Status: status}
	}
	if !ok {
		return PayloadKeys{}, &MeterError{Code: "meter_not_found", Message: fmt.Sprintf("Stripe has no active meter with event_name %q; create it first", eventName)}
	}
	if m.Formula != string(aggregation) {
		return PayloadKeys{}, &MeterError{Code: "meter_formula_mismatch",
			Message: fmt.Sprintf("Stripe's meter %s for %q aggregates by %s, not %s", m.ID, eventName, m.Formula, aggregation)}
	}
	if m.EventTimeWindow != "" {
		return PayloadKeys{}, &MeterError{Code: "meter_pre_aggregated",
			Message: fmt.Sprintf("Stripe's meter %s for %q is pre-aggregated (event_time_window %s): each event would replace the last of its %s; map a meter without an event time window", m.ID, eventName, m.EventTimeWindow, m.EventTimeWindow)}
	}
	return keysOf(m), nil
}

// keysOf is a meter's payload keys: an empty key is Stripe's default.
func keysOf(m stripeapi.Meter) PayloadKeys {
	k := PayloadKeys{Customer: m.CustomerPayloadKey, Value: m.ValuePayloadKey}
	if k.Customer == "" {
		k.Customer = DefaultCustomerPayloadKey
	}
	if k.Value == "" {
		k.Value = DefaultValuePayloadKey
	}
	return k
}
