// Package embeddedpg owns the lifecycle of a private PostgreSQL cluster built
// from the PostgreSQL server binaries installed on the machine: it finds the
// binaries, runs initdb once into a data directory it owns, starts the server
// as a child process listening only on 127.0.0.1, and stops it again. A server
// whose parent dies goes down with it: on Linux through the kernel's
// parent-death signal, on other Unix systems (macOS) through a watchdog
// process. Windows is not supported: Start says so and points at
// TALLY_DATABASE_URL.
//
// The files follow the steps: binaries.go finds the binaries, trust.go checks
// that nobody else could change the data directory, runas.go (with
// runas_unix.go and runas_windows.go) drops to an unprivileged user when the
// process is root, env.go gives the children an allow-listed environment,
// lock.go (with lock_unix.go and lock_windows.go) takes the data directory's
// lock, initdb.go creates the cluster, postmaster.go deals with a server
// already there, launch.go starts the server and cluster.go stops it,
// parentdeath*.go and watchdog.go take it down with a dead parent, and
// files.go (with files_unix.go and files_windows.go) holds the small file
// helpers. start.go ties the steps together.
//
// With Config.Workers it runs a Citus cluster instead (citus.go): the
// server becomes a coordinator, and each worker is a cluster of its own in
// a directory inside the data directory, started, guarded and stopped as
// the one server is, from a PostgreSQL with Citus built by `make citus`
// (FindCitus). Every node has the coordinator's password and connects to
// the others on loopback; the workers are added to every database that has
// the extension, again at every start.
//
// The package never touches a cluster it did not create: it refuses to reuse
// or delete a non-empty directory that is not a cluster, and it refuses to
// start when another process runs a server on the same data directory
// (lock.go). The server of a tally that was killed is not such a server: Start
// waits, bounded, for it to finish shutting down (postmaster.go). It never
// runs postgres or initdb as root (when the process is root they run as an
// unprivileged user), and it never logs the superuser password or a URL that
// contains it.
//
// The host cannot be turned against through it. The data directory and its
// ancestors must be owned by root or by the user tally runs as and not be
// writable by group or others (a sticky ancestor such as /tmp is fine); the
// unprivileged user owns only what tally gives it inside (pgdata and
// postgres.log), never the directory itself. Files there are opened without
// following symbolic links, refused when hard-linked, and handed to the
// unprivileged user by descriptor, never by path. The children get no variable
// of tally's environment but PATH, the library paths, the locale and the time
// zone, so tally's secrets never reach the server.
package embeddedpg
