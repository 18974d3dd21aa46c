-- The billing periods of the tenants' customers, as Stripe gives them.
--
-- stripe_subscription_items is Tally's copy of the metered items of the
-- subscriptions of every customer a tenant mapping names: one row per
-- account ('' is the node's destination, as tenant mappings name it) and
-- item, with the item's price, the meter it bills, the subscription's
-- billing cycle anchor and the item's current period. It is read from
-- Stripe when a tenant is mapped, when a customer.subscription.* event
-- arrives and every day. Rows are updated, never deleted: an item Stripe no
-- longer lists gets gone_at.
--
-- stripe_subscription_reads says, per customer, when it was last read and
-- the period anchor its subscriptions give (NULL: none, and a hand-set
-- anchor stays), with the subscription it came from, or why none could be
-- taken although the customer has metered items (problem).
--
-- Both grow with the customers, never with usage.

-- +goose Up
CREATE TABLE stripe_subscription_items (
    account              text        NOT NULL,
    item                 text        NOT NULL,
    customer             text        NOT NULL,
    subscription         text        NOT NULL,
    status               text        NOT NULL,
    price                text        NOT NULL,
    meter                text        NOT NULL,
    currency             text        NOT NULL,
    billing_interval     text        NOT NULL,
    interval_count       integer     NOT NULL,
    billing_cycle_anchor timestamptz NOT NULL,
    current_period_start timestamptz NOT NULL,
    current_period_end   timestamptz NOT NULL,
    start_date           timestamptz NOT NULL,
    ended_at             timestamptz,
    gone_at              timestamptz,
    read_at              timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (account, item),
    CONSTRAINT stripe_subscription_items_period_check CHECK (current_period_end > current_period_start)
);
CREATE INDEX stripe_subscription_items_customer ON stripe_subscription_items (account, customer);

CREATE TABLE stripe_subscription_reads (
    account      text        NOT NULL,
    customer     text        NOT NULL,
    read_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    anchor       timestamptz,
    subscription text,
    problem      text,
    PRIMARY KEY (account, customer),
    CONSTRAINT stripe_subscription_reads_problem_check CHECK (length(problem) <= 300)
);

-- +goose StatementBegin
DO $$
BEGIN
    IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'tally_runtime') THEN
        GRANT SELECT, INSERT, UPDATE ON stripe_subscription_items, stripe_subscription_reads TO tally_runtime;
        REVOKE DELETE, TRUNCATE ON stripe_subscription_items, stripe_subscription_reads FROM tally_runtime;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP TABLE stripe_subscription_reads;
DROP TABLE stripe_subscription_items;
