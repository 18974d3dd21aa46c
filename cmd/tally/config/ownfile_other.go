//go:build !unix

package config

import "os"

// OwnerProblem is not checked where files have no Unix owner and mode
// (Windows): the data directory's ACL guards tally dev's files there.
func OwnerProblem(os.FileInfo) string { return "" }
