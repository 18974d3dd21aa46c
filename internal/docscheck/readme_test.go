package docscheck

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestREADMEIsAFrontDoor keeps README.md short enough to be read: at most
// 250 lines, and a quick start of at most 15 (its heading to the next).
// Reference belongs in docs/.
func TestREADMEIsAFrontDoor(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > 250 {
		t.Errorf("README.md has %d lines, more than 250: move reference to docs/", len(lines))
	}
	start := -1
	for i, l := range lines {
		switch {
		case l == "## Quick start":
			start = i
		case start >= 0 && strings.HasPrefix(l, "## "):
			if n := i - start; n > 15 {
				t.Errorf("README.md's quick start has %d lines, more than 15", n)
			}
			return
		}
	}
	t.Error("README.md has no quick start followed by another section")
}
