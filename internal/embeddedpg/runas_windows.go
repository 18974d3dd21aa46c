package embeddedpg

import "os"

// fileOwner reports no owner: Windows files have no Unix uid and gid, and
// the process is never root (os.Geteuid is -1), so nothing runs as another
// user.
func fileOwner(os.FileInfo) (uid, gid uint32, ok bool) { return 0, 0, false }
