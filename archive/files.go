package archive

// kind is how a column is stored in Parquet. Every value is exact: whole
// numbers as INT64/INT32, numeric values as decimal strings, timestamps as
// TIMESTAMP(MICROS, UTC), JSON (bodies, id arrays) as its text.
type kind int

const (
	kindInt64 kind = iota
	kindInt32
	kindText
	kindBool
	kindTime
	kindJSON
	kindDecimal
)

// column is one column of an archive file: its name (the table's) and kind.
type column struct {
	name string
	kind kind
}

// file is one Parquet file of an archive: the rows of a table that belong
// to the period, in a stable order. Its query reads them in the archive's
// snapshot, after sqlItems filled archive_items; @from and @to bound the
// billing periods (starts in [from, to)).
type file struct {
	name  string
	table string
	// idColumn is the column whose range the manifest records.
	idColumn string
	// reference marks a table that grows after the archive (mapping
	// history): verify compares the database's rows up to the archived
	// range's end.
	reference bool
	query     string
	columns   []column
}

// sqlPeriodEvents selects the period's ledger rows: those staged into an
// item of a billing period that starts in [from, to). occurred_at bounds the
// scan as the completeness report's does (an event's period starts at most
// 32 days before it: the report's own bound), so that the ledger's
// occurred_at index (or the month's partitions) is read, not the ledger.
// An unstaged event of the period is refused before any file is written.
const sqlPeriodEvents = `
FROM usage_events e
JOIN outbox_item_bodies b ON b.id = e.item_id
WHERE e.occurred_at >= @from AND e.occurred_at < @to::timestamptz + interval '32 days'
  AND (b.payload ->> 'period')::timestamptz >= @from AND (b.payload ->> 'period')::timestamptz < @to`

// sqlItems fill archive_items with the ids of the period's items: those
// its ledger rows were staged into, the items that took back (or carried)
// its cancelled events, and every successor of those (re-addressing).
//
// They run first in the archive's snapshot, and set cursor_tuple_fraction
// for it: the files are read by cursors, which the planner otherwise plans
// for their first tenth (a fast start, such as the ledger read whole in
// item order by its item index), where an archive reads every row.
var sqlItems = []string{
	`SET LOCAL cursor_tuple_fraction = 1.0`,
	`CREATE TEMP TABLE archive_items (id bigint PRIMARY KEY) ON COMMIT DROP`,
	`INSERT INTO archive_items SELECT DISTINCT e.item_id ` + sqlPeriodEvents,
	`INSERT INTO archive_items
SELECT DISTINCT x FROM usage_cancellations c
JOIN usage_events e ON e.id = c.event_row
JOIN archive_items a ON a.id = e.item_id
CROSS JOIN LATERAL unnest(ARRAY[c.item_id, c.carried_by]) x
WHERE x IS NOT NULL
ON CONFLICT DO NOTHING`,
	`INSERT INTO archive_items
WITH RECURSIVE succ (id, depth) AS (
    SELECT s.superseded_by, 0 FROM outbox_item_states s JOIN archive_items a ON a.id = s.id WHERE s.superseded_by IS NOT NULL
    UNION
    SELECT s.superseded_by, c.depth + 1 FROM outbox_item_states s JOIN succ c ON s.id = c.id
    WHERE s.superseded_by IS NOT NULL AND c.depth < 1000
)
SELECT DISTINCT id FROM succ
ON CONFLICT DO NOTHING`,
	`ANALYZE archive_items`,
}

// The file names of an archive.
const (
	fileEvents        = "usage_events.parquet"
	fileCancellations = "usage_cancellations.parquet"
	fileBodies        = "outbox_item_bodies.parquet"
	fileStates        = "outbox_item_states.parquet"
	fileFeatureMaps   = "feature_mapping_versions.parquet"
)

// files are an archive's files, in the order they are written. The ledger
// is ordered by item (then id) and the items by id, so that verify
// recomputes the completeness totals in one merged pass over the three.
var files = []file{
	{name: fileEvents, table: "usage_events", idColumn: "id",
		query: `SELECT e.id, e.tenant, e.event_id, e.feature, e.value, e.occurred_at, e.timestamp_given, e.received_at,
       e.item_id, e.staged_at, e.cancelled_at ` + sqlPeriodEvents + ` ORDER BY e.item_id, e.id`,
		columns: []column{{"id", kindInt64}, {"tenant", kindText}, {"event_id", kindText}, {"feature", kindText},
			{"value", kindInt64}, {"occurred_at", kindTime}, {"timestamp_given", kindBool}, {"received_at", kindTime},
			{"item_id", kindInt64}, {"staged_at", kindTime}, {"cancelled_at", kindTime}}},
	{name: fileCancellations, table: "usage_cancellations", idColumn: "id",
		query: `SELECT c.id, c.tenant, c.event_id, c.event_row, c.outcome, c.reason, c.carried_by, c.item_id,
       c.requested_by, c.requested_at
FROM usage_cancellations c JOIN usage_events e ON e.id = c.event_row JOIN archive_items a ON a.id = e.item_id
WHERE e.occurred_at >= @from AND e.occurred_at < @to::timestamptz + interval '32 days'
ORDER BY c.id`,
		columns: []column{{"id", kindInt64}, {"tenant", kindText}, {"event_id", kindText}, {"event_row", kindInt64},
			{"outcome", kindText}, {"reason", kindText}, {"carried_by", kindInt64}, {"item_id", kindInt64},
			{"requested_by", kindText}, {"requested_at", kindTime}}},
	{name: fileBodies, table: "outbox_item_bodies", idColumn: "id",
		query: `SELECT b.id, b.tenant_key, b.subject_kind, b.subject_ref, b.exporter, b.destination_account, b.mode,
       b.mapping_version, b.identifier, b.payload::text, b.ordering_key, b.created_at
FROM outbox_item_bodies b JOIN archive_items a ON a.id = b.id ORDER BY b.id`,
		columns: []column{{"id", kindInt64}, {"tenant_key", kindText}, {"subject_kind", kindText}, {"subject_ref", kindText},
			{"exporter", kindText}, {"destination_account", kindText}, {"mode", kindText}, {"mapping_version", kindInt32},
			{"identifier", kindText}, {"payload", kindJSON}, {"ordering_key", kindText}, {"created_at", kindTime}}},
	{name: fileStates, table: "outbox_item_states", idColumn: "id",
		query: `SELECT s.id, s.exporter, s.mode, s.ordering_key, s.state, s.attempts, s.refused_attempts, s.attempts_base,
       s.next_attempt_at, s.first_attempt_at, s.lease_owner, s.leased_at, s.lease_expires_at, s.lease_token,
       s.provider_ref, s.accepted_at, s.confirmed_at, s.last_error_code, s.last_error_status, s.last_error,
       s.quarantine_reason, s.superseded_by, s.reported_state, s.reported_reason, s.reported_code,
       s.reported_message, s.created_at, s.updated_at, s.per_key_lease, s.meter
FROM outbox_item_states s JOIN archive_items a ON a.id = s.id ORDER BY s.id`,
		columns: []column{{"id", kindInt64}, {"exporter", kindText}, {"mode", kindText}, {"ordering_key", kindText},
			{"state", kindText}, {"attempts", kindInt32}, {"refused_attempts", kindInt32}, {"attempts_base", kindInt32},
			{"next_attempt_at", kindTime}, {"first_attempt_at", kindTime}, {"lease_owner", kindText}, {"leased_at", kindTime},
			{"lease_expires_at", kindTime}, {"lease_token", kindInt64}, {"provider_ref", kindText}, {"accepted_at", kindTime},
			{"confirmed_at", kindTime}, {"last_error_code", kindText}, {"last_error_status", kindInt32}, {"last_error", kindText},
			{"quarantine_reason", kindText}, {"superseded_by", kindInt64}, {"reported_state", kindText},
			{"reported_reason", kindText}, {"reported_code", kindText}, {"reported_message", kindText},
			{"created_at", kindTime}, {"updated_at", kindTime}, {"per_key_lease", kindBool}, {"meter", kindText}}},
	{name: "outbox_attempts.parquet", table: "outbox_attempts", idColumn: "item_id",
		query: `SELECT t.item_id, t.lease_token, t.lease_owner, t.leased_at, t.outcome, t.state_after, t.refused,
       t.provider_ref, t.error_code, t.error_status, t.error_message, t.recorded_at
FROM outbox_attempts t JOIN archive_items a ON a.id = t.item_id ORDER BY t.item_id, t.lease_token`,
		columns: []column{{"item_id", kindInt64}, {"lease_token", kindInt64}, {"lease_owner", kindText}, {"leased_at", kindTime},
			{"outcome", kindText}, {"state_after", kindText}, {"refused", kindBool}, {"provider_ref", kindText},
			{"error_code", kindText}, {"error_status", kindInt32}, {"error_message", kindText}, {"recorded_at", kindTime}}},
	{name: "meter_error_evidence.parquet", table: "meter_error_evidence", idColumn: "item_id",
		query: `SELECT m.event_id, m.identifier, m.item_id, m.code, m.message
FROM meter_error_evidence m JOIN archive_items a ON a.id = m.item_id ORDER BY m.item_id, m.event_id`,
		columns: []column{{"event_id", kindText}, {"identifier", kindText}, {"item_id", kindInt64}, {"code", kindText},
			{"message", kindText}}},
	{name: "reconcile_discrepancies.parquet", table: "reconcile_discrepancies", idColumn: "id",
		query: `SELECT d.id, d.run_id, d.destination_account, d.mode, d.event_name, d.meter, d.customer, d.hour, d.formula,
       d.expected::text, d.provider::text, d.difference::text, array_to_json(d.expected_items)::text,
       array_to_json(d.uncertain_items)::text, array_to_json(d.explained_by)::text, d.explanation, d.created_at,
       array_to_json(d.reported_items)::text, d.reason, d.error_code, d.error_status, d.kind,
       array_to_json(d.confirmed_items)::text, d.cleared_by_run
FROM reconcile_discrepancies d
WHERE EXISTS (SELECT FROM unnest(d.expected_items || d.uncertain_items || d.confirmed_items || d.reported_items) i
              JOIN archive_items a ON a.id = i)
ORDER BY d.id`,
		columns: []column{{"id", kindInt64}, {"run_id", kindInt64}, {"destination_account", kindText}, {"mode", kindText},
			{"event_name", kindText}, {"meter", kindText}, {"customer", kindText}, {"hour", kindTime}, {"formula", kindText},
			{"expected", kindDecimal}, {"provider", kindDecimal}, {"difference", kindDecimal}, {"expected_items", kindJSON},
			{"uncertain_items", kindJSON}, {"explained_by", kindJSON}, {"explanation", kindText}, {"created_at", kindTime},
			{"reported_items", kindJSON}, {"reason", kindText}, {"error_code", kindText}, {"error_status", kindInt32},
			{"kind", kindText}, {"confirmed_items", kindJSON}, {"cleared_by_run", kindInt64}}},
	{name: "reconcile_resolutions.parquet", table: "reconcile_resolutions", idColumn: "id",
		query: `SELECT r.id, r.discrepancy_id, r.destination_account, r.mode, r.event_name, r.customer, r.hour, r.reason,
       r.expected::text, r.provider::text, r.resolution, r.note, r.resolved_by, r.resolved_at,
       array_to_json(r.settled_items)::text
FROM reconcile_resolutions r
WHERE EXISTS (SELECT FROM unnest(r.settled_items) i JOIN archive_items a ON a.id = i)
   OR EXISTS (SELECT FROM reconcile_discrepancies d WHERE d.id = r.discrepancy_id
              AND EXISTS (SELECT FROM unnest(d.expected_items || d.uncertain_items || d.confirmed_items) i
                          JOIN archive_items a ON a.id = i))
ORDER BY r.id`,
		columns: []column{{"id", kindInt64}, {"discrepancy_id", kindInt64}, {"destination_account", kindText},
			{"mode", kindText}, {"event_name", kindText}, {"customer", kindText}, {"hour", kindTime}, {"reason", kindText},
			{"expected", kindDecimal}, {"provider", kindDecimal}, {"resolution", kindText}, {"note", kindText},
			{"resolved_by", kindText}, {"resolved_at", kindTime}, {"settled_items", kindJSON}}},
	{name: "audit_log.parquet", table: "audit_log", idColumn: "id",
		query: `SELECT l.id, l.at, l.actor, l.action, l.subject, l.from_state, l.to_state, l.reason, l.details::text
FROM audit_log l
WHERE l.subject LIKE 'item:%'
  AND CASE WHEN l.subject ~ '^item:[0-9]{1,18}$' THEN substr(l.subject, 6)::bigint END IN (SELECT id FROM archive_items)
ORDER BY l.id`,
		columns: []column{{"id", kindInt64}, {"at", kindTime}, {"actor", kindText}, {"action", kindText}, {"subject", kindText},
			{"from_state", kindText}, {"to_state", kindText}, {"reason", kindText}, {"details", kindJSON}}},
	{name: fileFeatureMaps, table: "feature_mapping_versions", idColumn: "version", reference: true,
		query: `SELECT v.version, v.feature, v.event_name, v.aggregation, v.window_seconds, v.changed_at, v.changed_by
FROM feature_mapping_versions v ORDER BY v.version`,
		columns: []column{{"version", kindInt32}, {"feature", kindText}, {"event_name", kindText}, {"aggregation", kindText},
			{"window_seconds", kindInt32}, {"changed_at", kindTime}, {"changed_by", kindText}}},
	{name: "tenant_mapping_versions.parquet", table: "tenant_mapping_versions", idColumn: "version", reference: true,
		query: `SELECT v.version, v.tenant, v.stripe_customer_id, v.period_anchor, v.changed_at, v.changed_by,
       v.invoice_grace::text, v.stripe_account
FROM tenant_mapping_versions v ORDER BY v.version`,
		columns: []column{{"version", kindInt32}, {"tenant", kindText}, {"stripe_customer_id", kindText},
			{"period_anchor", kindTime}, {"changed_at", kindTime}, {"changed_by", kindText}, {"invoice_grace", kindText},
			{"stripe_account", kindText}}},
}

// fileNamed is the file of that name, if it is one of files.
func fileNamed(name string) (file, bool) {
	for _, f := range files {
		if f.name == name {
			return f, true
		}
	}
	return file{}, false
}
