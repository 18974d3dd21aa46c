package migrations

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/tallymeter/tally/internal/pgdb"
)

// Placement is where one of Tally's tables lives on a Citus cluster.
type Placement string

// The placements (docs/scale.md): distributed tables are sharded by the
// tenant's bucket and co-located, so that a statement about one tenant runs
// on one worker; reference tables are copied to every node, for joins with
// them; local tables stay on the coordinator.
const (
	Distributed Placement = "distributed"
	Reference   Placement = "reference"
	Local       Placement = "local"
)

// Placements says where each of Tally's tables must live on Citus. Every
// table of the schema is here (a test holds the list to the schema), River's
// and goose's excepted: they are local.
var Placements = map[string]Placement{
	"usage_events":          Distributed,
	"usage_event_keys":      Distributed,
	"usage_cancellations":   Distributed,
	"outbox_item_bodies":    Distributed,
	"outbox_item_states":    Distributed,
	"outbox_attempts":       Distributed,
	"completeness_counters": Distributed,
	"completeness_items":    Distributed,

	"feature_mappings":          Reference,
	"feature_mapping_versions":  Reference,
	"tenant_mappings":           Reference,
	"tenant_mapping_versions":   Reference,
	"stripe_meters":             Reference,
	"stripe_customer_names":     Reference,
	"stripe_subscription_items": Reference,
	"stripe_subscription_reads": Reference,

	"api_tokens":              Local,
	"archives":                Local,
	"audit_log":               Local,
	"stripe_invoices":         Local,
	"stripe_prices":           Local,
	"invoice_checks":          Local,
	"invoice_gates":           Local,
	"billing_event_listings":  Local,
	"stripe_invoice_lines":    Local,
	"completeness_audits":     Local,
	"console_sessions":        Local,
	"meter_error_evidence":    Local,
	"outbox_gauge_settled":    Local,
	"outbox_snapshots":        Local,
	"reconcile_discrepancies": Local,
	"reconcile_key_periods":   Local,
	"reconcile_resolutions":   Local,
	"reconcile_runs":          Local,
	"report_snapshots":        Local,
	"stripe_event_listings":   Local,
	"stripe_events":           Local,
	"usage_closed_months":     Local,
}

// Engine is what runs the database: plain PostgreSQL, or Citus with its
// nodes and where each of Tally's tables is.
type Engine struct {
	// Server is PostgreSQL's version, e.g. "15.18".
	Server string
	// Citus is Citus's release, e.g. "13.2.2", empty on plain PostgreSQL.
	Citus string
	// Nodes are the cluster's nodes, the coordinator first; none on plain
	// PostgreSQL.
	Nodes []Node
	// Tables are Tally's tables with where they are and where they must
	// be, by name; none on plain PostgreSQL.
	Tables []TablePlacement
}

// Node is one node of a Citus cluster.
type Node struct {
	Host        string
	Port        int
	Coordinator bool
	// Active is false for a node Citus was told is out of service
	// (citus_disable_node): its shards' statements fail.
	Active bool
}

// TablePlacement is one table of Placements on a Citus cluster.
type TablePlacement struct {
	Name string
	Want Placement
	// Have is where it is; "" when the table is missing.
	Have Placement
}

// Misplaced returns the tables that are not where Placements says.
func (e Engine) Misplaced() []TablePlacement {
	var out []TablePlacement
	for _, t := range e.Tables {
		if t.Have != t.Want {
			out = append(out, t)
		}
	}
	return out
}

// Workers returns the cluster's worker nodes.
func (e Engine) Workers() []Node {
	var out []Node
	for _, n := range e.Nodes {
		if !n.Coordinator {
			out = append(out, n)
		}
	}
	return out
}

// String names the engine in a few words.
func (e Engine) String() string {
	if e.Citus == "" {
		return "PostgreSQL " + e.Server
	}
	return fmt.Sprintf("Citus %s on PostgreSQL %s, %d workers", e.Citus, e.Server, len(e.Workers()))
}

// ReadEngine reads which engine db is and, on Citus, its nodes and where
// Tally's tables are. Any role may: it reads the server's settings and
// Citus's metadata tables.
func ReadEngine(ctx context.Context, db pgdb.Querier) (Engine, error) {
	var e Engine
	err := db.QueryRow(ctx, `SELECT current_setting('server_version'),
			coalesce((SELECT extversion FROM pg_extension WHERE extname = 'citus'), '')`).Scan(&e.Server, &e.Citus)
	if err != nil {
		return e, fmt.Errorf("migrate: reading the server's version: %w", err)
	}
	e.Server, _, _ = strings.Cut(e.Server, " ")
	if e.Citus == "" {
		return e, nil
	}
	// The extension's version (13.2-1) is its schema's; citus_version()
	// names the release.
	var release string
	if err := db.QueryRow(ctx, `SELECT citus_version()`).Scan(&release); err != nil {
		return e, fmt.Errorf("migrate: reading Citus's version: %w", err)
	}
	if f := strings.Fields(release); len(f) > 1 && f[0] == "Citus" {
		e.Citus = f[1]
	}
	rows, err := db.Query(ctx, `SELECT nodename, nodeport, groupid = 0, isactive FROM pg_dist_node
		WHERE noderole = 'primary' ORDER BY groupid, nodename, nodeport`)
	if err != nil {
		return e, fmt.Errorf("migrate: reading Citus's nodes: %w", err)
	}
	for rows.Next() {
		var n Node
		if err := rows.Scan(&n.Host, &n.Port, &n.Coordinator, &n.Active); err != nil {
			rows.Close()
			return e, fmt.Errorf("migrate: reading Citus's nodes: %w", err)
		}
		e.Nodes = append(e.Nodes, n)
	}
	if err := rows.Err(); err != nil {
		return e, fmt.Errorf("migrate: reading Citus's nodes: %w", err)
	}

	names := make([]string, 0, len(Placements))
	for name := range Placements {
		names = append(names, name)
	}
	slices.Sort(names)
	// A hash-distributed table has partmethod 'h'; a reference table 'n'
	// with replication model 't' (two-phase commit to every node); a table
	// missing from pg_dist_partition, or a Citus local table, is local.
	rows, err = db.Query(ctx, `SELECT n.name,
			CASE WHEN c.oid IS NULL THEN ''
			     WHEN p.partmethod = 'h' THEN 'distributed'
			     WHEN p.partmethod = 'n' AND p.repmodel = 't' THEN 'reference'
			     ELSE 'local' END
		FROM unnest($1::text[]) AS n(name)
		LEFT JOIN pg_class c ON c.relname = n.name AND c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
		LEFT JOIN pg_dist_partition p ON p.logicalrelid = c.oid
		ORDER BY n.name`, names)
	if err != nil {
		return e, fmt.Errorf("migrate: reading where Tally's tables are: %w", err)
	}
	for rows.Next() {
		var t TablePlacement
		if err := rows.Scan(&t.Name, &t.Have); err != nil {
			rows.Close()
			return e, fmt.Errorf("migrate: reading where Tally's tables are: %w", err)
		}
		t.Want = Placements[t.Name]
		e.Tables = append(e.Tables, t)
	}
	if err := rows.Err(); err != nil {
		return e, fmt.Errorf("migrate: reading where Tally's tables are: %w", err)
	}
	return e, nil
}
