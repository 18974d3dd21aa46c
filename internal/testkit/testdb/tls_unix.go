//go:build unix

package testdb

import (
	"os"
	"os/user"
	"strconv"
)

// ownByCluster gives name to the user the cluster runs as when the tests
// run as root (ClusterUser).
func ownByCluster(name string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	uid, gid, err := ClusterUser()
	if err != nil {
		return err
	}
	return os.Lchown(name, uid, gid)
}

// ClusterUser is the user the tests' cluster runs as when they run as
// root: embeddedpg's default, postgres if that user exists, else nobody.
func ClusterUser() (uid, gid int, err error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		if u, err = user.Lookup("nobody"); err != nil {
			return 0, 0, err
		}
	}
	uid, _ = strconv.Atoi(u.Uid)
	gid, _ = strconv.Atoi(u.Gid)
	return uid, gid, nil
}
