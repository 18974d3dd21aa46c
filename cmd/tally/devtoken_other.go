//go:build !unix

package main

import "os"

// ownerProblem is not checked where files have no Unix owner and mode
// (Windows): the data directory's ACL guards the token files there.
func ownerProblem(os.FileInfo) string { return "" }
