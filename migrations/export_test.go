package migrations

// SessionSettings returns migration 44, for tests that build a goose provider
// of their own over this directory.
var SessionSettings = sessionSettings
