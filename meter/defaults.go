package meter

import "time"

// DefaultStageInterval is how often the periodic staging pass runs
// (PeriodicStages; TALLY_STAGE_INTERVAL): a closed window waits at most this
// long, after its end and the grace (DefaultGrace), to be staged.
const DefaultStageInterval = 10 * time.Second

// DefaultInvoiceGrace is Stripe's default invoice finalization grace
// period (TALLY_INVOICE_GRACE): usage staged more than this long after its
// billing period ended is late (docs/stripe.md).
const DefaultInvoiceGrace = time.Hour

// DefaultLateUsage is what staging does with late usage by default
// (TALLY_LATE_USAGE).
const DefaultLateUsage = LateQuarantine
