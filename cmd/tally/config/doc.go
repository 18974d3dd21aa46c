// Package config reads Tally's settings: each from its environment variable,
// overridden by a command-line flag of the same meaning, with defaults
// named once, as constants of the package that owns each setting
// (outbox.DefaultLease, meter.DefaultGrace, exporter.DefaultWorkers,
// reconcile.DefaultSchedule, stripeapi.DefaultAPIBase…) or of this package
// for the node's own (DefaultListen…). It validates the whole configuration
// before anything starts, and reports every problem at once. The secret
// settings may instead be read from the file their <VAR>_FILE names
// (settings_secrets.go), so that none needs a flag. Operator commands run
// beside `tally dev` take what they need to reach its database and Stripe
// simulator from the dev.env it writes in its data directory (devenv.go),
// unless the environment or flags say otherwise.
//
// It never reads a setting anywhere else, and never echoes the value of a
// setting that may hold a secret (the database URL's password).
package config
