// Package docscheck holds the tests that keep the Markdown documentation
// true: every link of README.md, CHANGELOG.md and docs/ leads to a file
// that exists and a heading it has, and docs/commands.md has a row for
// every command tally's usage text lists. It has no code of its own.
package docscheck
