//go:build unix

package testdb

import (
	"os"
	"os/user"
	"strconv"
)

// ownByCluster gives name to the user the cluster runs as when the tests
// run as root: embeddedpg's default, postgres if that user exists, else
// nobody.
func ownByCluster(name string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		if u, err = user.Lookup("nobody"); err != nil {
			return err
		}
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	return os.Lchown(name, uid, gid)
}
