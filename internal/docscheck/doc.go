// Package docscheck holds the tests that keep the Markdown documentation
// true to itself: every link of README.md, CHANGELOG.md and docs/ leads to a
// file that exists and a heading it has. It has no code of its own.
package docscheck
