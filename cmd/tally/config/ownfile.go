package config

import (
	"fmt"
	"io"
	"os"
)

// maxOwnFileBytes is the most ReadOwnFile reads.
const maxOwnFileBytes = 4096

// ReadOwnFile reads a file tally dev writes in its data directory (its
// tokens, DevEnvFile) if it is a regular file (not a link) that tally dev
// could have written: owned by this user, mode 0600 or narrower
// (OwnerProblem; not checked on Windows). Any other is refused, naming the
// file and why, never its content; use says what it would have been used
// for ("as a token"). It reads at most 4096 bytes.
func ReadOwnFile(path, use string) ([]byte, error) {
	link, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	if !link.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file (a link or a directory): tally dev did not make it; remove it and start again", path)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !os.SameFile(link, fi) {
		return nil, fmt.Errorf("%s changed while it was read; start again", path)
	}
	if problem := OwnerProblem(fi); problem != "" {
		return nil, fmt.Errorf("%s %s: tally dev did not make it, or it was changed since; it is not used %s. Remove it and start again", path, problem, use)
	}
	return io.ReadAll(io.LimitReader(f, maxOwnFileBytes))
}
