package docscheck

import (
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"
)

// root is the repository, from this package's folder.
const root = "../.."

var (
	fence     = regexp.MustCompile("^\\s*(```|~~~)")
	heading   = regexp.MustCompile(`^(#{1,6})\s+(.*?)\s*#*\s*$`)
	codeSpan  = regexp.MustCompile("(`+)[^`]*?(`+)")
	inline    = regexp.MustCompile(`!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"]*")?\s*\)`)
	reference = regexp.MustCompile(`\[((?:[^\[\]]|\[[^\[\]]*\])+)\]\[([^\[\]]*)\]`)
	definest  = regexp.MustCompile(`^\s{0,3}\[([^\]]+)\]:\s*<?(\S+?)>?(?:\s+.*)?$`)
	autolink  = regexp.MustCompile(`<(https?://[^>\s]+)>`)
	htmlID    = regexp.MustCompile(`<a\s+(?:name|id)="([^"]+)"`)
)

// doc is one Markdown file as the link check sees it.
type doc struct {
	path    string            // relative to the repository
	anchors map[string]bool   // the slugs of its headings, and its HTML anchors
	links   []link            // every link, in order
	defs    map[string]string // reference definitions: label → target
}

// link is one link of a document.
type link struct {
	line   int
	target string
	ref    string // the label of a reference link, whose target is a definition
}

// TestLinksResolve fails on a link of README.md, CHANGELOG.md or docs/*.md
// to a file that does not exist or a heading its file does not have, on a
// reference link without its definition, and on an http(s) link that is not
// a well-formed URL. External links are not fetched.
func TestLinksResolve(t *testing.T) {
	t.Parallel()
	paths := []string{"README.md", "CHANGELOG.md"}
	more, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range more {
		rel, err := filepath.Rel(root, p)
		if err != nil {
			t.Fatal(err)
		}
		paths = append(paths, filepath.ToSlash(rel))
	}
	docs := map[string]*doc{}
	for _, p := range paths {
		d, err := parse(p)
		if err != nil {
			t.Fatal(err)
		}
		docs[p] = d
	}
	n := 0
	for _, p := range paths {
		d := docs[p]
		for _, l := range d.links {
			n++
			target := l.target
			if l.ref != "" {
				var ok bool
				if target, ok = d.defs[strings.ToLower(l.ref)]; !ok {
					t.Errorf("%s:%d: the reference [%s] has no definition", p, l.line, l.ref)
					continue
				}
			}
			if err := resolve(docs, p, target); err != nil {
				t.Errorf("%s:%d: %s: %v", p, l.line, target, err)
			}
		}
	}
	if n < 100 {
		t.Fatalf("only %d links found: the parser is broken", n)
	}
}

// resolve checks one target of a link in the document at from.
func resolve(docs map[string]*doc, from, target string) error {
	if target == "" {
		return fmt.Errorf("an empty link")
	}
	u, err := url.Parse(target)
	if err != nil {
		return err
	}
	switch u.Scheme {
	case "http", "https":
		if u.Host == "" || strings.ContainsAny(target, " <>\"") {
			return fmt.Errorf("not a well-formed URL")
		}
		return nil
	case "mailto":
		return nil
	case "":
	default:
		return fmt.Errorf("a link of scheme %q", u.Scheme)
	}
	file := from
	if u.Path != "" {
		if strings.HasPrefix(u.Path, "/") {
			return fmt.Errorf("an absolute path: links are relative to their file")
		}
		file = filepath.ToSlash(filepath.Join(filepath.Dir(from), u.Path))
		if _, err := os.Stat(filepath.Join(root, file)); err != nil {
			return fmt.Errorf("no file %s", file)
		}
	}
	if u.Fragment == "" {
		return nil
	}
	d, ok := docs[file]
	if !ok {
		if !strings.HasSuffix(file, ".md") {
			return nil // a line anchor of a source file, say
		}
		var err error
		if d, err = parse(file); err != nil {
			return err
		}
		docs[file] = d
	}
	if !d.anchors[u.Fragment] {
		return fmt.Errorf("%s has no heading #%s", file, u.Fragment)
	}
	return nil
}

// parse reads the Markdown file at path (relative to the repository): its
// headings' anchors, its links and its reference definitions, outside code.
func parse(path string) (*doc, error) {
	b, err := os.ReadFile(filepath.Join(root, path))
	if err != nil {
		return nil, err
	}
	d := &doc{path: path, anchors: map[string]bool{}, defs: map[string]string{}}
	seen := map[string]int{}
	inCode := false
	for i, line := range strings.Split(string(b), "\n") {
		if fence.MatchString(line) {
			inCode = !inCode
			continue
		}
		if inCode {
			continue
		}
		for _, m := range htmlID.FindAllStringSubmatch(line, -1) {
			d.anchors[m[1]] = true
		}
		if m := heading.FindStringSubmatch(line); m != nil {
			s := slug(m[2])
			if k := seen[s]; k > 0 {
				d.anchors[fmt.Sprintf("%s-%d", s, k)] = true
			} else {
				d.anchors[s] = true
			}
			seen[s]++
		}
		if m := definest.FindStringSubmatch(line); m != nil {
			d.defs[strings.ToLower(m[1])] = m[2]
			d.links = append(d.links, link{line: i + 1, target: m[2]})
			continue
		}
		text := codeSpan.ReplaceAllString(line, "C")
		for _, m := range inline.FindAllStringSubmatch(text, -1) {
			d.links = append(d.links, link{line: i + 1, target: m[2]})
		}
		for _, m := range reference.FindAllStringSubmatch(text, -1) {
			ref := m[2]
			if ref == "" {
				ref = m[1]
			}
			d.links = append(d.links, link{line: i + 1, ref: ref})
		}
		for _, m := range autolink.FindAllStringSubmatch(text, -1) {
			d.links = append(d.links, link{line: i + 1, target: m[1]})
		}
	}
	return d, nil
}

var (
	linkText = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
	htmlTag  = regexp.MustCompile(`<[^>]+>`)
)

// slug is the anchor GitHub gives a heading: its text without links' targets
// and HTML tags, lower-cased, with spaces as hyphens and every other
// character but letters, digits, hyphens and underscores dropped.
func slug(h string) string {
	h = htmlTag.ReplaceAllString(linkText.ReplaceAllString(h, "$1"), "")
	var b strings.Builder
	for _, r := range strings.ToLower(h) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) || unicode.Is(unicode.Mn, r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

func TestSlug(t *testing.T) {
	t.Parallel()
	for h, want := range map[string]string{
		"Quick start":                          "quick-start",
		"`tally dev`":                          "tally-dev",
		"`dev.env`: the commands beside `dev`": "devenv-the-commands-beside-dev",
		"PgBouncer and managed Postgres":       "pgbouncer-and-managed-postgres",
		"Roles: nothing leaves the database before its period is archived": "roles-nothing-leaves-the-database-before-its-period-is-archived",
		"Archive → verify → detach":                                        "archive--verify--detach",
		"T9r — supersede":                                                  "t9r--supersede",
		"[The API](api.md) & `tally_runtime`":                              "the-api--tally_runtime",
		"Ingest, 100M/month":                                               "ingest-100mmonth",
	} {
		if got := slug(h); got != want {
			t.Errorf("slug(%q) = %q, want %q", h, got, want)
		}
	}
}
