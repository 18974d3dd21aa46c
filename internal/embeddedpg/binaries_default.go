//go:build !darwin

package embeddedpg

// searchGlobs is where FindBinaries looks when PATH has no server binaries.
// It is a variable only so that tests can point it at an empty directory.
var searchGlobs = []string{"/usr/lib/postgresql/*/bin"}

// installAdvice says how to install PostgreSQL's server binaries.
const installAdvice = "Debian: apt-get install postgresql"
