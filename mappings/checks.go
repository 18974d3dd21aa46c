package mappings

import (
	"context"
	"errors"
	"fmt"
)

// Checker verifies mappings against the account the node exports to (and
// a tenant mapping against the connected account it names). Every door —
// the API, `tally mappings … set` and the console — sets mappings through
// PutFeature and PutTenant, which ask it: one set of checks, whichever
// door a mapping comes through.
type Checker interface {
	MeterChecker
	CustomerChecker
	AccountChecker
}

// CustomerChecker verifies a tenant mapping's customer.
type CustomerChecker interface {
	// CheckCustomer returns nil when account (a connected account, acct_…;
	// "" is the account the node exports to) has the customer, a
	// *CustomerError when it has none by that id or deleted it, an
	// *AccountError when the key may not act for account, and an
	// *ErrProviderUnavailable when it could not be asked.
	CheckCustomer(ctx context.Context, account, customerID string) error
}

// AccountChecker verifies a tenant mapping's connected account.
type AccountChecker interface {
	// CheckAccount returns nil when the platform's key may act for account
	// (acct_…, Stripe Connect), an *AccountError when Stripe says it may
	// not, and an *ErrProviderUnavailable when it could not be asked.
	CheckAccount(ctx context.Context, account string) error
}

// The codes of a refused mapping, the same at every door (the API's error
// code, the CLI's message, the console's notice); a *MeterError carries
// its own (meter_not_found, meter_formula_mismatch, meter_pre_aggregated,
// meter_payload_key_invalid).
const (
	// CodeInvalidMapping: the input is malformed (a *ValidationError).
	CodeInvalidMapping = "invalid_mapping"
	// CodeCustomerNotFound: the account has no customer with the id.
	CodeCustomerNotFound = "customer_not_found"
	// CodeCustomerDeleted: the account deleted the customer.
	CodeCustomerDeleted = "customer_deleted"
	// CodeAccountUnreachable: the platform's key may not act for the
	// connected account a tenant mapping names (an *AccountError).
	CodeAccountUnreachable = "account_unreachable"
	// CodeStripeUnavailable: Stripe could not be asked; nothing was saved.
	CodeStripeUnavailable = "stripe_unavailable"
)

// CustomerError says why the account's customers do not fit a tenant
// mapping.
type CustomerError struct {
	// Code is CodeCustomerNotFound or CodeCustomerDeleted.
	Code    string
	Message string
}

func (e *CustomerError) Error() string { return "mappings: " + e.Message }

// AccountError says the platform's key may not act for the connected
// account a tenant mapping names: Stripe answered account_invalid, or
// refused the key (401, 403), for that account.
type AccountError struct {
	// Code is CodeAccountUnreachable.
	Code string
	// Account is the connected account (acct_…).
	Account string
	Message string
}

func (e *AccountError) Error() string { return "mappings: " + e.Message }

// UncheckedWarning is what every door says of a mapping saved on a node
// without a Stripe key (no Checker): it is saved — nothing can be exported
// until a key is set anyway — its audit entry says it was not checked, and
// `tally doctor` checks every mapping against Stripe once a key is set.
const UncheckedWarning = "saved without checking Stripe: this node has no STRIPE_API_KEY; once one is set, tally doctor checks every mapping's meter and customer"

// UncheckedReason is the reason of the audit entry of a mapping saved
// without a Checker.
const UncheckedReason = "not checked against Stripe: no Stripe key"

// Warning is UncheckedWarning when the store saves mappings without
// checking them (no Checker), else empty.
func (s *Store) Warning() string {
	if s.Checker == nil {
		return UncheckedWarning
	}
	return ""
}

// auditReason is the reason of a mapping change's audit entry:
// UncheckedReason without a Checker, else none.
func (s *Store) auditReason() string {
	if s.Checker == nil {
		return UncheckedReason
	}
	return ""
}

// Refusal is why PutFeature or PutTenant did not save a mapping, as every
// door shows it.
type Refusal struct {
	// Code is CodeInvalidMapping, a *MeterError's code, CodeCustomerNotFound,
	// CodeCustomerDeleted, CodeAccountUnreachable or CodeStripeUnavailable.
	Code string
	// Message says what is wrong and what to do, without a secret.
	Message string
	// Fields lists the bad fields of malformed input (CodeInvalidMapping).
	Fields []FieldError
	// Unavailable says Stripe could not be asked: try again (the API
	// answers 503, the others 422).
	Unavailable bool
}

// RefusalOf returns the refusal err carries: false for any other error (a
// database failure), which is not the caller's to fix.
func RefusalOf(err error) (Refusal, bool) {
	var (
		ve *ValidationError
		me *MeterError
		ce *CustomerError
		ae *AccountError
		pu *ErrProviderUnavailable
	)
	switch {
	case errors.As(err, &ve):
		return Refusal{Code: CodeInvalidMapping, Message: ve.Error()[len("mappings: "):], Fields: ve.Fields}, true
	case errors.As(err, &me):
		return Refusal{Code: me.Code, Message: me.Message}, true
	case errors.As(err, &ce):
		return Refusal{Code: ce.Code, Message: ce.Message}, true
	case errors.As(err, &ae):
		return Refusal{Code: ae.Code, Message: ae.Message}, true
	case errors.As(err, &pu):
		then := "try again"
		if pu.Status == 401 || pu.Status == 403 { // the key refused, or not allowed to read
			then = "check STRIPE_API_KEY and STRIPE_ACCOUNT; a restricted key needs meters and customers (read)"
		}
		return Refusal{Code: CodeStripeUnavailable, Unavailable: true, Message: fmt.Sprintf(
			"the mapping could not be checked against Stripe (%s, status %d); nothing was saved: %s", pu.Code, pu.Status, then)}, true
	}
	return Refusal{}, false
}
