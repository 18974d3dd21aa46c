package main

import (
	"context"
	"crypto/rand"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tallymeter/tally/internal/auth"
)

// tokensCreateFlags are the flags of tally tokens create.
type tokensCreateFlags struct {
	role, name, expiresIn string
	tenants               stringList
	corrections           bool
}

// tokensCreateCommand is tally tokens create: a new API token, its secret
// printed once.
func tokensCreateCommand() command {
	f := &tokensCreateFlags{}
	return command{name: "tokens create", flags: f.register, run: f.run}
}

func (f *tokensCreateFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.role, "role", "", "ingest, finance, operator or admin (required)")
	fs.StringVar(&f.name, "name", "", "the token's name, shown in audit trails (default: role and a random suffix)")
	fs.Var(&f.tenants, "tenant", "scope an ingest token to this tenant (repeatable)")
	fs.StringVar(&f.expiresIn, "expires-in", "", "end the token after this long: a Go duration (720h) or days (90d) (default: never)")
	fs.BoolVar(&f.corrections, "corrections", false, "let an ingest or finance token post corrections (negative values); operator and admin tokens always may")
}

func (f *tokensCreateFlags) run(ctx context.Context, e *env, _ []string) error {
	role, err := auth.ParseRole(f.role)
	if err != nil {
		return usageError{err.Error()}
	}
	var lifetime time.Duration
	if f.expiresIn != "" {
		if lifetime, err = parseLifetime(f.expiresIn); err != nil {
			return usageError{err.Error()}
		}
	}
	name := f.name
	if name == "" {
		var raw [4]byte
		_, _ = rand.Read(raw[:])
		name = fmt.Sprintf("%s-%x", role, raw)
	}
	tok, err := auth.Create(ctx, e.db.Pool, auth.TokenSpec{Name: name, Role: role, Tenants: f.tenants, Corrections: f.corrections,
		ExpiresIn: lifetime, By: who()})
	if err != nil {
		return err
	}
	expiry := ""
	if tok.ExpiresAt != nil {
		expiry = ", expiring " + tok.ExpiresAt.UTC().Format(time.RFC3339)
	}
	corrections := ""
	if tok.Corrections {
		corrections = ", allowed to post corrections"
	}
	fmt.Fprintf(e.stderr, "Created %s token %q%s%s%s. It is shown once; Tally keeps only its hash.\n", role, name, scopeText(tok.Tenants),
		corrections, expiry)
	fmt.Fprintln(e.stdout, tok.Secret)
	return nil
}

// parseLifetime reads --expires-in: a Go duration, or a whole number of
// days ("90d"); positive.
func parseLifetime(s string) (time.Duration, error) {
	var (
		d   time.Duration
		err error
	)
	if days, ok := strings.CutSuffix(s, "d"); ok {
		var n int64
		n, err = strconv.ParseInt(days, 10, 64)
		if err == nil && n > 0 && n <= maxLifetimeDays {
			d = time.Duration(n) * 24 * time.Hour
		}
	} else {
		d, err = time.ParseDuration(s)
	}
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("--expires-in must be a positive duration (720h, 90m) or a number of days up to %d (90d), got %q", maxLifetimeDays, s)
	}
	return d, nil
}

// maxLifetimeDays is the longest --expires-in in days: about as long as a
// time.Duration reaches.
const maxLifetimeDays = 100_000

func scopeText(tenants []string) string {
	if len(tenants) == 0 {
		return ""
	}
	return " for tenants " + strings.Join(tenants, ", ")
}

// tokensListCommand is tally tokens list: every token, live and revoked,
// without secrets.
func tokensListCommand() command {
	return command{name: "tokens list", run: runTokensList}
}

func runTokensList(ctx context.Context, e *env, _ []string) error {
	tokens, err := auth.ListTokens(ctx, e.db.Pool)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tROLE\tTENANTS\tCREATED\tREVOKED\tEXPIRES\tLAST USED\tCORRECTIONS")
	for _, t := range tokens {
		tenants := "(all)"
		if t.Tenants != nil {
			tenants = strings.Join(t.Tenants, ",")
		}
		corrections := "no"
		if t.Corrections {
			corrections = "yes"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", t.Name, t.Role, tenants, t.CreatedAt.UTC().Format(time.RFC3339),
			timeText(t.RevokedAt, ""), timeText(t.ExpiresAt, "never"), timeText(t.LastUsedAt, "never"), corrections)
	}
	return tw.Flush()
}

// timeText is t in UTC, or none when it is nil.
func timeText(t *time.Time, none string) string {
	if t == nil {
		return none
	}
	return t.UTC().Format(time.RFC3339)
}

// tokensRevokeCommand is tally tokens revoke NAME.
func tokensRevokeCommand() command {
	return command{name: "tokens revoke", args: exactly(1, "a token name"), run: func(ctx context.Context, e *env, args []string) error {
		if err := auth.RevokeAs(ctx, e.db.Pool, args[0], who()); err != nil {
			return err
		}
		fmt.Fprintf(e.stdout, "revoked %s\n", args[0])
		return nil
	}}
}
