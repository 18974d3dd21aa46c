-- The completeness counters' slots, owned a transaction at a time.
--
-- A backend added to the slot pg_backend_pid() mod 16, so two backends
-- could share a slot; a transaction that moves usage in several
-- statements (a deliverer recording a batch's outcomes, staging, a
-- cancellation) locks counter rows statement by statement, and two such
-- transactions on one slot could each hold a row the other needed next: a
-- deadlock, which failed the outcomes' write (they are claimed again and
-- resent under their identifiers, so nothing is billed twice, but it is
-- work and noise). Now a transaction takes a slot of its own on its first
-- write — a transaction-level advisory lock on one of slots 1 to 63 — and
-- keeps it to its end: no two transactions write one counter row at once.
-- Beyond 63 writing at once, a transaction shares a slot as before.
--
-- Slot 0 is written only by the fold and the recount. The fold now skips
-- the rows a writer holds (they are folded the next night), so it never
-- waits for a writer while holding rows that writer may want.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_slot() RETURNS smallint LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    s     integer := nullif(current_setting('tally.completeness_slot', true), '')::integer;
    first integer := pg_backend_pid() % 63;
BEGIN
    IF s IS NOT NULL THEN
        RETURN s;
    END IF;
    FOR i IN 0..62 LOOP
        s := 1 + (first + i) % 63;
        IF pg_try_advisory_xact_lock(1129206866, s) THEN
            PERFORM set_config('tally.completeness_slot', s::text, true);
            RETURN s;
        END IF;
    END LOOP;
    RETURN 1 + first;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_fold(p_to timestamptz) RETURNS bigint LANGUAGE plpgsql
AS $$
DECLARE
    n bigint;
BEGIN
    WITH victims AS (
        SELECT period, tenant, feature, account, slot FROM completeness_counters
        WHERE period < p_to AND slot <> 0
        ORDER BY period, tenant, feature, account, slot
        FOR UPDATE SKIP LOCKED
    ),
    moved AS (
        DELETE FROM completeness_counters c USING victims v
        WHERE (c.period, c.tenant, c.feature, c.account, c.slot) = (v.period, v.tenant, v.feature, v.account, v.slot)
        RETURNING c.*
    ),
    summed AS (
        INSERT INTO completeness_counters AS c
        SELECT period, tenant, feature, account, 0,
               sum(ingested_events), sum(ingested_value), sum(confirmed_events), sum(confirmed_value),
               sum(accepted_events), sum(accepted_value), sum(pending_events), sum(pending_value),
               sum(unstaged_events), sum(unstaged_value), sum(quarantined_events), sum(quarantined_value),
               sum(uncertain_events), sum(uncertain_value), sum(rejected_events), sum(rejected_value),
               sum(cancelled_events), sum(cancelled_value), sum(period_closed_events), sum(period_closed_value),
               sum(items), sum(inconsistent)
        FROM moved
        GROUP BY period, tenant, feature, account
        ORDER BY period, tenant, feature, account
        ON CONFLICT (period, tenant, feature, account, slot) DO UPDATE SET
            ingested_events = c.ingested_events + excluded.ingested_events, ingested_value = c.ingested_value + excluded.ingested_value,
            confirmed_events = c.confirmed_events + excluded.confirmed_events, confirmed_value = c.confirmed_value + excluded.confirmed_value,
            accepted_events = c.accepted_events + excluded.accepted_events, accepted_value = c.accepted_value + excluded.accepted_value,
            pending_events = c.pending_events + excluded.pending_events, pending_value = c.pending_value + excluded.pending_value,
            unstaged_events = c.unstaged_events + excluded.unstaged_events, unstaged_value = c.unstaged_value + excluded.unstaged_value,
            quarantined_events = c.quarantined_events + excluded.quarantined_events, quarantined_value = c.quarantined_value + excluded.quarantined_value,
            uncertain_events = c.uncertain_events + excluded.uncertain_events, uncertain_value = c.uncertain_value + excluded.uncertain_value,
            rejected_events = c.rejected_events + excluded.rejected_events, rejected_value = c.rejected_value + excluded.rejected_value,
            cancelled_events = c.cancelled_events + excluded.cancelled_events, cancelled_value = c.cancelled_value + excluded.cancelled_value,
            period_closed_events = c.period_closed_events + excluded.period_closed_events,
            period_closed_value = c.period_closed_value + excluded.period_closed_value,
            items = c.items + excluded.items, inconsistent = c.inconsistent + excluded.inconsistent
        RETURNING 1
    )
    SELECT count(*) FROM moved INTO n;
    RETURN n;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_slot() RETURNS smallint LANGUAGE sql STABLE PARALLEL SAFE
AS $$ SELECT (pg_backend_pid() % 16)::smallint $$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION completeness_fold(p_to timestamptz) RETURNS bigint LANGUAGE plpgsql
AS $$
DECLARE
    n bigint;
BEGIN
    WITH moved AS (
        DELETE FROM completeness_counters WHERE period < p_to AND slot <> 0 RETURNING *
    ),
    summed AS (
        INSERT INTO completeness_counters AS c
        SELECT period, tenant, feature, account, 0,
               sum(ingested_events), sum(ingested_value), sum(confirmed_events), sum(confirmed_value),
               sum(accepted_events), sum(accepted_value), sum(pending_events), sum(pending_value),
               sum(unstaged_events), sum(unstaged_value), sum(quarantined_events), sum(quarantined_value),
               sum(uncertain_events), sum(uncertain_value), sum(rejected_events), sum(rejected_value),
               sum(cancelled_events), sum(cancelled_value), sum(period_closed_events), sum(period_closed_value),
               sum(items), sum(inconsistent)
        FROM moved
        GROUP BY period, tenant, feature, account
        ORDER BY period, tenant, feature, account
        ON CONFLICT (period, tenant, feature, account, slot) DO UPDATE SET
            ingested_events = c.ingested_events + excluded.ingested_events, ingested_value = c.ingested_value + excluded.ingested_value,
            confirmed_events = c.confirmed_events + excluded.confirmed_events, confirmed_value = c.confirmed_value + excluded.confirmed_value,
            accepted_events = c.accepted_events + excluded.accepted_events, accepted_value = c.accepted_value + excluded.accepted_value,
            pending_events = c.pending_events + excluded.pending_events, pending_value = c.pending_value + excluded.pending_value,
            unstaged_events = c.unstaged_events + excluded.unstaged_events, unstaged_value = c.unstaged_value + excluded.unstaged_value,
            quarantined_events = c.quarantined_events + excluded.quarantined_events, quarantined_value = c.quarantined_value + excluded.quarantined_value,
            uncertain_events = c.uncertain_events + excluded.uncertain_events, uncertain_value = c.uncertain_value + excluded.uncertain_value,
            rejected_events = c.rejected_events + excluded.rejected_events, rejected_value = c.rejected_value + excluded.rejected_value,
            cancelled_events = c.cancelled_events + excluded.cancelled_events, cancelled_value = c.cancelled_value + excluded.cancelled_value,
            period_closed_events = c.period_closed_events + excluded.period_closed_events,
            period_closed_value = c.period_closed_value + excluded.period_closed_value,
            items = c.items + excluded.items, inconsistent = c.inconsistent + excluded.inconsistent
        RETURNING 1
    )
    SELECT count(*) FROM moved INTO n;
    RETURN n;
END
$$;
-- +goose StatementEnd
