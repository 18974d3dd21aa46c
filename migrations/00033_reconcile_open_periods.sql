-- Reconciliation re-reads open billing periods, and a discrepancy stays
-- open across runs (docs/reconciliation.md, "Open periods" and "Open
-- discrepancies").
--
-- tally_period_end(t, anchor) is the end of the billing period containing
-- t (the start of the next one): the period that contains its start plus
-- 744 hours, a month being 28 to 31 days. Hours, not days, so that no
-- session time zone moves it. package meter's PeriodEnd is the same
-- function in Go.
--
-- reconcile_key_periods: for each key a run compared (mode and ordering
-- key: account, customer, event name), the billing periods — tenant and
-- period start, as the key's items carry them — that were still open (not
-- past their end plus the invoice grace) when it did. A run lists the keys
-- whose periods are open now from it, so that a key whose items are all
-- confirmed is read again until its periods close: over-billing in a
-- confirmed hour is found. Written in each key's commit; the run deletes
-- the rows no grace can keep open (start more than 34 days ago: 31 days
-- of period and 72 hours of grace), so the table holds the open keys and
-- no history. Filled here from the confirmed items of the last 35 days (a
-- period starting 34 days ago or later; an item is made at most minutes
-- before its timestamp): one scan of the state table, and a read of the
-- body of each such item (seconds per million items). The accepted and
-- uncertain items' keys need no row: a run lists them from the outbox.
--
-- reconcile_discrepancies gains:
--   kind             what the numbers say, derived (a generated column):
--                    stripe_has_more (Stripe's number is above Tally's: a
--                    customer may be billed too much), stripe_has_less
--                    (below, or no value where Tally expects one: usage
--                    not billed), summaries_refused (no number);
--   confirmed_items  the expected items that were confirmed already when
--                    compared: Stripe's number moved after it had matched;
--   cleared_by_run   the later run that compared the same hour of the same
--                    key again (a refused key: read the key again) and
--                    found it matching, or recorded (or found resolved)
--                    numbers of its own: the discrepancy is no longer the
--                    current one. A discrepancy is open while unresolved
--                    and not cleared. Before, the latest succeeded run's
--                    discrepancies were the current ones: every older row
--                    is cleared by that run, and of later rows (a run that
--                    failed after it) the latest of each hour stays.
-- The partial index finds a key's current discrepancies (the run's
-- clearing, one statement per key) and every open one (lists, the
-- console, the metric); it holds only rows not cleared.
--
-- tenant_mappings_customer finds the tenants of a discrepancy that names
-- no item (an hour Stripe has and Tally has nothing of) by its customer.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION tally_period_end(t timestamptz, anchor timestamptz) RETURNS timestamptz
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT tally_period_start(tally_period_start(t, anchor) + interval '744 hours', anchor)
$$;
-- +goose StatementEnd

CREATE TABLE reconcile_key_periods (
    mode                text NOT NULL,
    ordering_key        text NOT NULL,
    tenant_key          text NOT NULL,
    period_start        timestamptz NOT NULL,
    destination_account text NOT NULL,
    customer            text NOT NULL,
    event_name          text NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (mode, ordering_key, tenant_key, period_start)
);
CREATE INDEX reconcile_key_periods_start ON reconcile_key_periods (period_start);

INSERT INTO reconcile_key_periods (mode, ordering_key, tenant_key, period_start, destination_account, customer, event_name)
SELECT DISTINCT s.mode, b.ordering_key, b.tenant_key, (b.payload ->> 'period')::timestamptz, b.destination_account,
       b.payload ->> 'customer', b.payload ->> 'event_name'
FROM outbox_item_states s JOIN outbox_item_bodies b ON b.id = s.id
WHERE s.state = 'confirmed' AND s.created_at > clock_timestamp() - interval '35 days'
  AND (b.payload ->> 'period')::timestamptz > clock_timestamp() - interval '34 days'
ON CONFLICT DO NOTHING;

ALTER TABLE reconcile_discrepancies
    ADD COLUMN kind text GENERATED ALWAYS AS (CASE
        WHEN reason = 'summaries_refused' THEN 'summaries_refused'
        WHEN provider IS NULL OR provider < expected THEN 'stripe_has_less'
        ELSE 'stripe_has_more' END) STORED,
    ADD COLUMN confirmed_items bigint[] NOT NULL DEFAULT '{}',
    ADD COLUMN cleared_by_run bigint REFERENCES reconcile_runs (id),
    ADD CONSTRAINT reconcile_discrepancies_cleared_check CHECK (cleared_by_run > run_id);

UPDATE reconcile_discrepancies d SET cleared_by_run = l.id
FROM (SELECT max(id) AS id FROM reconcile_runs WHERE status = 'succeeded') l
WHERE d.run_id < l.id;
UPDATE reconcile_discrepancies d SET cleared_by_run = n.run_id
FROM (SELECT destination_account, mode, event_name, customer, hour, max(run_id) AS run_id
      FROM reconcile_discrepancies WHERE cleared_by_run IS NULL GROUP BY 1, 2, 3, 4, 5) n
WHERE d.cleared_by_run IS NULL AND d.run_id < n.run_id
  AND (d.destination_account, d.mode, d.event_name, d.customer, d.hour) = (n.destination_account, n.mode, n.event_name, n.customer, n.hour);

CREATE INDEX reconcile_discrepancies_current ON reconcile_discrepancies (destination_account, mode, event_name, customer, hour)
    WHERE cleared_by_run IS NULL;
CREATE INDEX tenant_mappings_customer ON tenant_mappings (stripe_customer_id);

-- +goose Down
DROP INDEX tenant_mappings_customer;
DROP INDEX reconcile_discrepancies_current;
ALTER TABLE reconcile_discrepancies DROP CONSTRAINT reconcile_discrepancies_cleared_check,
    DROP COLUMN cleared_by_run, DROP COLUMN confirmed_items, DROP COLUMN kind;
DROP TABLE reconcile_key_periods;
DROP FUNCTION tally_period_end(timestamptz, timestamptz);
