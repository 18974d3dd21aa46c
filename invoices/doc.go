// Package invoices owns what Stripe bills the tenants' customers: their
// invoices and lines, read from Stripe when an invoice.* event arrives and
// kept in stripe_invoices and stripe_invoice_lines with the prices their
// lines name (stripe_prices); and the comparison of each finalized invoice
// with the usage of its period (invoice_checks), which finance resolves.
//
// It never changes an outbox item or a ledger row, never deletes a row of
// its own tables (a line an invoice no longer lists is marked gone), and
// never acts on an invoice of a customer no tenant maps.
package invoices
