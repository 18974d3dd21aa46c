#!/bin/bash
# run.sh DB FILE: runs a file on the coordinator, quietly, stopping at the first error.
/work/citus-build/prefix/lib/postgresql/15/bin/psql -h 127.0.0.1 -p 26430 -U postgres -d $1 -X -q -v ON_ERROR_STOP=1 -f $2 -o /dev/null
