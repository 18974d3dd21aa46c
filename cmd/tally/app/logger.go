package app

import (
	"context"
	"log/slog"
	"os"
	"strings"

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

// Handle passes r on, River's error about a context already canceled as a
// warning: at shutdown River may be inserting a periodic job when its
// context ends, and fails to notify the queues, which poll anyway.
func (q quieter) Handle(ctx context.Context, r slog.Record) error {
	if r.Level == slog.LevelError && canceledErr(r) {
		w := slog.NewRecord(r.Time, slog.LevelWarn, r.Message, r.PC)
		r.Attrs(func(a slog.Attr) bool {
			w.AddAttrs(a)
			return true
		})
		if !q.Enabled(ctx, w.Level) {
			return nil
		}
		r = w
	}
	return q.Handler.Handle(ctx, r)
}

// canceledErr reports whether r's err attribute says its context was
// canceled.
func canceledErr(r slog.Record) bool {
	found := false
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "err" && strings.Contains(a.Value.String(), context.Canceled.Error()) {
			found = true
			return false
		}
		return true
	})
	return found
}
