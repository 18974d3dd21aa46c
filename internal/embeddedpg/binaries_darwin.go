package embeddedpg

// searchGlobs is where FindBinaries looks when PATH has no server binaries.
// It is a variable only so that tests can point it at an empty directory.
var searchGlobs = macSearchGlobs("/")

// installAdvice says how to install PostgreSQL's server binaries.
const installAdvice = "macOS: brew install postgresql@17, or Postgres.app"
