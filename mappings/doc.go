// Package mappings owns what operators maintain: feature mappings (a feature
// to a Stripe meter's event name, its aggregation, its window, the meter's
// payload keys of the customer and the value — read from the meter when
// the mapping is set — and, when it is not the node's default, the exporter
// of its items) and tenant mappings (a tenant to its Stripe customer,
// billing-period anchor, invoice grace and, for a Stripe Connect platform,
// the connected account its usage goes to).
// Every door (the API, the CLI, the console) sets mappings through one
// Store, whose Checker holds them against the account the node exports to:
// a feature's meter exists with its formula and payload keys, a tenant's
// customer exists, not deleted — in the tenant's connected account when it
// names one, which the platform's key must be allowed to act for;
// RefusalOf gives every door the same code.
// Without a key they are saved unchecked, with UncheckedWarning.
// The names of the tenants' customers are kept as Stripe last gave them
// (TenantCustomers): read with the check when a tenant mapping is saved,
// and again every day by NamesWorker, so that no page asks Stripe. So are
// their metered subscription items (SyncSubscriptions): a customer whose
// monthly subscription bills a mapped meter gives its tenants that
// subscription's billing cycle anchor.
// Every change takes the next number of one sequence shared by both kinds
// and keeps the previous versions, so that an item built from them carries
// the greater of its feature's and tenant's versions, and any change that
// could alter its payload gives a higher one.
//
// It never rewrites history (a change is a new version; an identical PUT is
// no change) and never touches outbox items: re-addressing is package
// quarantine's, through package outbox.
package mappings
