package embeddedpg

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// TestStartUnsupported: on Windows Start refuses clearly, before touching
// the data directory, and points at TALLY_DATABASE_URL.
func TestStartUnsupported(t *testing.T) {
	_, err := Start(context.Background(), Config{DataDir: t.TempDir()})
	if !errors.Is(err, errors.ErrUnsupported) || !strings.Contains(err.Error(), "not supported on Windows") ||
		!strings.Contains(err.Error(), "TALLY_DATABASE_URL") {
		t.Fatalf("Start on Windows: %v", err)
	}
}
