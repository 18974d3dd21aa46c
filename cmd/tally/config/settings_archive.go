package config

// archiveSettings are tally archive's: where archives go, and how an
// S3-compatible store is reached.
func archiveSettings() []setting {
	return []setting{
		{"TALLY_ARCHIVE_URL", "archive-url", "where tally archive writes: a directory (a path or file:///path) or s3://bucket/prefix; unset: the archive directory in the data directory", "",
			str(func(c *Config) *string { return &c.ArchiveURL })},
		{"TALLY_ARCHIVE_ENDPOINT", "archive-endpoint", "the S3-compatible server of an s3:// archive URL: host[:port] (HTTPS) or an http:// or https:// URL; unset: Amazon S3", "",
			str(func(c *Config) *string { return &c.ArchiveEndpoint })},
		{"TALLY_ARCHIVE_REGION", "archive-region", "the bucket's region; unset: asked of the server", "",
			str(func(c *Config) *string { return &c.ArchiveRegion })},
		{"TALLY_ARCHIVE_ACCESS_KEY", "archive-access-key", "the S3 access key; unset: AWS_ACCESS_KEY_ID", "",
			str(func(c *Config) *string { return &c.ArchiveAccessKey })},
		{"TALLY_ARCHIVE_SECRET_KEY", "archive-secret-key", "the S3 secret key (or TALLY_ARCHIVE_SECRET_KEY_FILE); unset: AWS_SECRET_ACCESS_KEY", "",
			str(func(c *Config) *string { return &c.ArchiveSecretKey })},
	}
}
