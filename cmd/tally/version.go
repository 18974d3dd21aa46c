package main

// Set at link time (-ldflags -X) by `make image`, never at run time.
var (
	// version is this build's version, from git describe; "dev" when the
	// build was not stamped (go run, go build).
	version = "dev"
	// image is "true" in the container image's binary, which has no
	// PostgreSQL beside it to start an embedded cluster from: a command
	// that needs a database must be given TALLY_DATABASE_URL.
	image = ""
)

// noEmbeddedPostgres is the one line a command that needs a database says
// in the container image when TALLY_DATABASE_URL is unset.
const noEmbeddedPostgres = "TALLY_DATABASE_URL is not set, and this image has no embedded PostgreSQL: set it to your database's URL (docs/operations.md#container-image)"
