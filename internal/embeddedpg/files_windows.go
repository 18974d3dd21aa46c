package embeddedpg

import "os"

// noFollow is 0: Windows has no O_NOFOLLOW (and no cluster starts there).
const noFollow = 0

// openDir opens the directory path.
func openDir(path string) (*os.File, error) { return os.Open(path) }

// fileLinks reports one link: no cluster starts on Windows.
func fileLinks(os.FileInfo) uint64 { return 1 }
