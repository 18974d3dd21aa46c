# reset.sh DB: a fresh Tally database on the three nodes, migrated on the coordinator.
set -e
B=/work/citus-build/prefix/lib/postgresql/15/bin
DB=${1:-tally}
for p in 26431 26432 26430; do $B/psql -h 127.0.0.1 -p $p -U postgres -qc "drop database if exists $DB with (force)" 2>/dev/null; done
for p in 26430 26431 26432; do $B/psql -h 127.0.0.1 -p $p -U postgres -qc "create database $DB"; $B/psql -h 127.0.0.1 -p $p -U postgres -d $DB -qc "create extension citus"; done
$B/psql -h 127.0.0.1 -p 26430 -U postgres -d $DB -qAt -c "select citus_set_coordinator_host('127.0.0.1',26430)" -c "select citus_add_node('127.0.0.1',26431)" -c "select citus_add_node('127.0.0.1',26432)" >/dev/null
TALLY_DATABASE_URL="postgres://postgres@127.0.0.1:26430/$DB?sslmode=disable" /tmp/citusdesign/tally migrate
