package outbox_test

import (
	"io"
	"log/slog"
	"strings"
)

func stringsReader(s string) io.Reader { return strings.NewReader(s) }

func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }
