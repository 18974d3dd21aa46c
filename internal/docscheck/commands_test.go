package docscheck

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestCommandsDocumented fails when a command or subcommand of tally's
// usage text (cmd/tally/main.go, what `tally help` prints) has no row in
// docs/commands.md.
func TestCommandsDocumented(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile(filepath.Join(root, "docs", "commands.md"))
	if err != nil {
		t.Fatal(err)
	}
	names := commandNames(t)
	if len(names) < 20 {
		t.Fatalf("only %d commands in tally's usage text: the parser is broken", len(names))
	}
	for _, name := range names {
		if !strings.Contains(string(doc), "`tally "+name) {
			t.Errorf("docs/commands.md has no row for `tally %s`", name)
		}
	}
}

// commandNames reads the usage constant of cmd/tally/main.go and returns
// the name of each command it lists: the words before its first argument
// (an upper-case placeholder), flags that select a form kept ("recover
// --plan").
func commandNames(t *testing.T) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), filepath.Join(root, "cmd", "tally", "main.go"), nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var text string
	ast.Inspect(f, func(n ast.Node) bool {
		spec, ok := n.(*ast.ValueSpec)
		if !ok || len(spec.Names) != 1 || spec.Names[0].Name != "usage" || len(spec.Values) != 1 {
			return true
		}
		if lit, ok := spec.Values[0].(*ast.BasicLit); ok {
			if text, err = strconv.Unquote(lit.Value); err != nil {
				t.Fatal(err)
			}
		}
		return false
	})
	_, list, ok := strings.Cut(text, "\nCommands:\n")
	if !ok {
		t.Fatal("cmd/tally/main.go's usage text has no Commands: list")
	}
	list, _, _ = strings.Cut(list, "\n\n")
	var names []string
	for _, line := range strings.Split(list, "\n") {
		head, _, _ := strings.Cut(strings.TrimSpace(line), "  ")
		var words []string
		for _, w := range strings.Fields(head) {
			if strings.ToLower(w) != w || strings.HasSuffix(w, "…") {
				break
			}
			words = append(words, w)
		}
		if len(words) > 0 {
			names = append(names, strings.Join(words, " "))
		}
	}
	return names
}
