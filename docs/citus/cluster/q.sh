#!/bin/bash
# q.sh DB: runs stdin's SQL on the coordinator, echoing it.
/work/citus-build/prefix/lib/postgresql/15/bin/psql -h 127.0.0.1 -p 26430 -U postgres -d ${1:-tally} -X -v ON_ERROR_STOP=${STOP:-0} "${@:2}"
