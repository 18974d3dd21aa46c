package app

import (
	"context"
	"log/slog"
	"os"

	"github.com/tallymeter/tally/cmd/tally/config"
)

// NewLogger returns the process logger for cfg, writing to stderr.
func NewLogger(cfg config.Config) *slog.Logger {
	var level slog.Level
	_ = level.UnmarshalText([]byte(cfg.LogLevel))
	opts := &slog.HandlerOptions{Level: level}
	if cfg.LogFormat == "json" {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}

// quieter passes on only records at or above min (and what the handler it
// wraps lets through): River reports its job counts at info every few
// seconds, which would drown the node's own log.
type quieter struct {
	slog.Handler
	min slog.Level
}

func (q quieter) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= q.min && q.Handler.Enabled(ctx, l)
}

func (q quieter) WithAttrs(as []slog.Attr) slog.Handler {
	return quieter{q.Handler.WithAttrs(as), q.min}
}
func (q quieter) WithGroup(n string) slog.Handler { return quieter{q.Handler.WithGroup(n), q.min} }
