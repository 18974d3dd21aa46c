// Package pricing computes what a Stripe Price bills for one billing period's
// metered usage, following the rules Stripe documents for per-unit, package
// (transform_quantity), graduated and volume prices, so that Tally can show
// finance the amount its ledger's usage should bill and the amount at risk.
//
// The package owns three things: the arithmetic of a Price applied to a
// quantity (Evaluate), the minor units of Stripe's currencies and their
// display in major units (MinorUnits, Format), and per-currency totals of
// several lines (Totals). Amounts are in the currency's minor units, as
// Stripe's API has them.
//
// Amounts are before tax, discounts, coupons, credits, customer balance,
// prorations and minimum charges: none of those is modelled. A Quote is what
// one invoice line of the price comes to, nothing more.
//
// What the package must never do:
//
//   - talk to Stripe, or to anything else: it is pure arithmetic on the Price
//     it is handed (expanded by the caller where Stripe requires it);
//   - add amounts of two currencies: Totals keeps one sum per currency;
//   - guess a price it cannot evaluate: anything it does not model, or that
//     Stripe's documentation leaves open in a way that changes the amount,
//     is refused with a *NotModeled error that carries a stable code and a
//     reason. Where Stripe's documentation leaves a rounding open, the Quote
//     says which reading Amount follows, gives the exact amount, and bounds
//     the alternatives (MinAmount, MaxAmount, Caveats).
//
// The Stripe behaviours relied on are listed, with their sources, in the
// project's docs/stripe.md.
package pricing
