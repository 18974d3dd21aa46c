//go:build !linux

package main

// followGoRun is Linux-only; elsewhere stop `go run` with Ctrl-C, which the
// terminal delivers to tally as well.
func followGoRun() {}
