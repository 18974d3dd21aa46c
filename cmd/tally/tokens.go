package main

import (
	"context"
	"crypto/rand"
	"flag"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tallymeter/tally/internal/auth"
)

// tokensCreateFlags are the flags of tally tokens create.
type tokensCreateFlags struct {
	role, name string
	tenants    stringList
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
}

func (f *tokensCreateFlags) run(ctx context.Context, e *env, _ []string) error {
	role, err := auth.ParseRole(f.role)
	if err != nil {
		return usageError{err.Error()}
	}
	name := f.name
	if name == "" {
		var raw [4]byte
		_, _ = rand.Read(raw[:])
		name = fmt.Sprintf("%s-%x", role, raw)
	}
	tok, err := auth.CreateToken(ctx, e.db.Pool, name, role, f.tenants)
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stderr, "Created %s token %q%s. It is shown once; Tally keeps only its hash.\n", role, name, scopeText(tok.Tenants))
	fmt.Fprintln(e.stdout, tok.Secret)
	return nil
}

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
	fmt.Fprintln(tw, "NAME\tROLE\tTENANTS\tCREATED\tREVOKED")
	for _, t := range tokens {
		tenants := "(all)"
		if t.Tenants != nil {
			tenants = strings.Join(t.Tenants, ",")
		}
		rev := ""
		if t.RevokedAt != nil {
			rev = t.RevokedAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", t.Name, t.Role, tenants, t.CreatedAt.UTC().Format(time.RFC3339), rev)
	}
	return tw.Flush()
}

// tokensRevokeCommand is tally tokens revoke NAME.
func tokensRevokeCommand() command {
	return command{name: "tokens revoke", args: exactly(1, "a token name"), run: func(ctx context.Context, e *env, args []string) error {
		if err := auth.Revoke(ctx, e.db.Pool, args[0]); err != nil {
			return err
		}
		fmt.Fprintf(e.stdout, "revoked %s\n", args[0])
		return nil
	}}
}
