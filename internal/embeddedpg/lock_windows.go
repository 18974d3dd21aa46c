package embeddedpg

import "os"

// lockFile does nothing: no cluster starts on Windows.
func lockFile(*os.File) error { return nil }

// probeLock reports false: no cluster starts on Windows.
func probeLock(*os.File) bool { return false }
