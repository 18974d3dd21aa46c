set -e
B=/work/citus-build/prefix/lib/postgresql/15/bin
cd /tmp/citusdesign
for n in 0 1 2; do
  port=$((26430+n))
  if [ ! -d d$n ]; then
    $B/initdb -D d$n -U postgres --auth=trust -E UTF8 --locale=C >/dev/null
    cat >> d$n/postgresql.conf <<CONF
shared_preload_libraries = 'citus'
port = $port
listen_addresses = '127.0.0.1'
unix_socket_directories = '/tmp/citusdesign'
citus.node_conninfo = 'sslmode=disable'
fsync = off
max_prepared_transactions = 100
wal_level = logical
max_connections = 200
CONF
  fi
  $B/pg_ctl -D d$n -l log$n -w start >/dev/null
done
