// Package app wires Tally's parts into the commands of cmd/tally: it opens
// the database (starting the embedded cluster when no URL is configured),
// migrates it, builds the domain parts from the configuration, and runs the
// service until its context ends — a list of services that share one
// start/stop contract, started in order and stopped in reverse.
//
// It owns process lifecycle only: no SQL of its own (the embedded cluster
// creates its database, the owners read their tables), no domain logic.
package app
