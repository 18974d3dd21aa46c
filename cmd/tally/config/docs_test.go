package config

import (
	"flag"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the generated table of docs/configuration.md")

const (
	docsPath  = "../../../docs/configuration.md"
	beginMark = "<!-- BEGIN GENERATED: every setting, from package config's settings table; `go test ./cmd/tally/config -run TestDocsConfiguration -update` rewrites it -->"
	endMark   = "<!-- END GENERATED -->"
)

// variable is a setting's variable named in a usage text, which the table
// sets as code.
var variable = regexp.MustCompile(`\b(?:TALLY|STRIPE|AWS)_[A-Z0-9_]+\b`)

// unsetAs finds what a setting without a default does unset, which the
// table gives as its default: the usage before it, what, and the usage after.
var unsetAs = regexp.MustCompile(`^(.*?)(?:; )?unset: ([^;]*)(.*)$`)

// TestDocsConfiguration keeps docs/configuration.md's table the settings
// table as the help prints it: every setting's variable, flag, default and
// usage, in the order of settings.
func TestDocsConfiguration(t *testing.T) {
	var b strings.Builder
	b.WriteString(beginMark + "\n\n| variable | flag | default | meaning |\n|---|---|---|---|\n")
	for _, s := range settings() {
		def, meaning := "unset", s.usage
		if m := unsetAs.FindStringSubmatch(meaning); m != nil {
			def, meaning = "unset: "+strings.TrimSpace(m[2]), m[1]+m[3]
		}
		if s.def != "" {
			def = "`" + s.def + "`"
		}
		file := slices.Contains(secretSettings, s.env) && !strings.Contains(meaning, s.env+"_FILE")
		def = variable.ReplaceAllString(def, "`$0`")
		meaning = variable.ReplaceAllString(strings.ReplaceAll(meaning, "|", `\|`), "`$0`")
		if file {
			meaning += "; or the file `" + s.env + "_FILE` names"
		}
		b.WriteString("| `" + s.env + "` | `--" + s.flag + "` | " + def + " | " + meaning + " |\n")
	}
	b.WriteString("\n" + endMark)
	want := b.String()

	doc, err := os.ReadFile(docsPath)
	if err != nil {
		t.Fatal(err)
	}
	text := string(doc)
	i, j := strings.Index(text, beginMark), strings.Index(text, endMark)
	if i < 0 || j < i {
		t.Fatalf("%s lacks the generated-section markers", docsPath)
	}
	if text[i:j+len(endMark)] == want {
		return
	}
	if !*update {
		t.Fatalf("%s is out of date with the settings; run: go test ./cmd/tally/config -run TestDocsConfiguration -update", docsPath)
	}
	if err := os.WriteFile(docsPath, []byte(text[:i]+want+text[j+len(endMark):]), 0o644); err != nil {
		t.Fatal(err)
	}
}
