-- The outbox notifies its deliverers itself (outbox.NotifyChannel, sent by
-- the outbox package in the transaction that stages a pending item or puts
-- one back to pending), no longer from triggers on outbox_item_states: on
-- a distributed database a trigger fires on the node that holds the row,
-- and a NOTIFY there makes a write that lands on two nodes fail at commit
-- (it cannot be prepared), while the application's pg_notify runs where
-- the transaction began. Channel and payload are unchanged: 'tally_outbox',
-- ''.

-- +goose Up
DROP TRIGGER outbox_item_states_notify_pending ON outbox_item_states;
DROP TRIGGER outbox_item_states_notify_insert ON outbox_item_states;
DROP FUNCTION outbox_notify();

-- +goose Down
-- +goose StatementBegin
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('tally_outbox', '');
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER outbox_item_states_notify_insert AFTER INSERT ON outbox_item_states
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify();
CREATE TRIGGER outbox_item_states_notify_pending AFTER UPDATE ON outbox_item_states
    FOR EACH ROW WHEN (NEW.state = 'pending' AND OLD.state IN ('quarantined', 'uncertain'))
    EXECUTE FUNCTION outbox_notify();
