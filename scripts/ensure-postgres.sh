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
ls -d /usr/lib/postgresql/*/bin | tail -1
