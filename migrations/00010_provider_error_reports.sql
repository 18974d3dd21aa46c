-- T10: an accepted item that Stripe's asynchronous meter error report names
-- as failed moves to quarantined (a cause a mapping fix can cure: no meter,
-- no such customer) or rejected (any other refusal). The edge guard gains
-- ('accepted', 'quarantined') and ('accepted', 'rejected'); every other edge
-- is as migration 1 made it.

-- +goose Up
DROP TRIGGER outbox_items_edges ON outbox_items;
CREATE TRIGGER outbox_items_edges BEFORE UPDATE ON outbox_items
    FOR EACH ROW WHEN (NEW.state <> OLD.state AND (OLD.state, NEW.state) NOT IN (
        ('pending', 'leased'),                                  -- T1
        ('leased', 'accepted'), ('leased', 'pending'),          -- T2, T3
        ('leased', 'uncertain'), ('leased', 'rejected'),        -- T4, T5
        ('leased', 'quarantined'),                              -- T6
        ('accepted', 'confirmed'),                              -- T7
        ('uncertain', 'accepted'), ('uncertain', 'pending'), ('uncertain', 'rejected'), -- T8
        ('quarantined', 'pending'), ('quarantined', 'superseded'),                      -- T9, T9r
        ('pending', 'uncertain'),                               -- T4 by the maintenance sweep
        ('accepted', 'quarantined'), ('accepted', 'rejected'))) -- T10, on the provider's error report
    EXECUTE FUNCTION outbox_refuse('not an edge of the state machine');

-- +goose Down
DROP TRIGGER outbox_items_edges ON outbox_items;
CREATE TRIGGER outbox_items_edges BEFORE UPDATE ON outbox_items
    FOR EACH ROW WHEN (NEW.state <> OLD.state AND (OLD.state, NEW.state) NOT IN (
        ('pending', 'leased'),                                  -- T1
        ('leased', 'accepted'), ('leased', 'pending'),          -- T2, T3
        ('leased', 'uncertain'), ('leased', 'rejected'),        -- T4, T5
        ('leased', 'quarantined'),                              -- T6
        ('accepted', 'confirmed'),                              -- T7
        ('uncertain', 'accepted'), ('uncertain', 'pending'), ('uncertain', 'rejected'), -- T8
        ('quarantined', 'pending'), ('quarantined', 'superseded'),                      -- T9, T9r
        ('pending', 'uncertain')))                              -- T4 by the maintenance sweep
    EXECUTE FUNCTION outbox_refuse('not an edge of the state machine');
