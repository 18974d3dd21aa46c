-- Deliverers wait on LISTEN tally_outbox: an insert into the outbox, or an
-- operator putting an item back to pending (T8, T9), wakes them at once. A
-- retry (T3) schedules its next attempt in the future; the poll interval
-- finds it. Notifications with the same payload in one transaction are
-- delivered once.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('tally_outbox', '');
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER outbox_items_notify_insert AFTER INSERT ON outbox_items
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
CREATE TRIGGER outbox_items_notify_pending AFTER UPDATE ON outbox_items
    FOR EACH ROW WHEN (NEW.state = 'pending' AND OLD.state IN ('quarantined', 'uncertain'))
    EXECUTE FUNCTION outbox_notify();

-- +goose Down
DROP TRIGGER outbox_items_notify_pending ON outbox_items;
DROP TRIGGER outbox_items_notify_insert ON outbox_items;
DROP FUNCTION outbox_notify();
