// Package embeddedpg owns the lifecycle of a private PostgreSQL cluster built
// from the PostgreSQL server binaries installed on the machine: it finds the
// binaries, runs initdb once into a data directory it owns, starts the server
// as a child process listening only on 127.0.0.1, and stops it again. A
// server whose parent dies goes down with it: on Linux through the kernel's
// parent-death signal, on other Unix systems (macOS) through a watchdog
// process. Windows is not supported: Start says so and points at
// TALLY_DATABASE_URL.
//
// The files follow the steps: binaries.go finds the binaries, runas.go (with
// runas_unix.go and runas_windows.go) drops to an unprivileged user when the
// process is root, initdb.go creates the cluster, launch.go starts the server
// and cluster.go stops it, parentdeath*.go and watchdog.go take it down with
// a dead parent, and files.go holds the small file helpers. start.go ties the
// steps together.
//
// The package never touches a cluster it did not create: it refuses to reuse
// or delete a non-empty directory that is not a cluster, and it refuses to
// start when another server is running on the same data directory. It never
// runs postgres or initdb as root (when the process is root they run as an
// unprivileged user), and it never logs the superuser password or a URL that
// contains it.
package embeddedpg
