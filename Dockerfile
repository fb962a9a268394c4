# syntax=docker/dockerfile:1
# One image for every pgherd process: the operator Deployment (`pgherd operator`), the PostgreSQL
# pods and the backup/restore Jobs (`pgherd-backup ...`). Built on the official PostgreSQL image,
# so the server, pg_basebackup and pg_rewind are the ones PostgreSQL ships.
#
#   docker build -t ghcr.io/pgherd/pgherd:0.1.0 .                                  # PostgreSQL 16
#   docker build --build-arg PG_MAJOR=17 -t ghcr.io/pgherd/pgherd:0.1.0-pg17 .     # another major
ARG PG_MAJOR=16
FROM postgres:${PG_MAJOR}-bookworm

LABEL org.opencontainers.image.title="pgherd" \
      org.opencontainers.image.description="PostgreSQL with the pgherd operator and backup agent" \
      org.opencontainers.image.licenses="Apache-2.0"

# Debian bookworm's python3 is 3.11, the version pgherd requires. curl: restore_command asks the
# instance's WAL service over a Unix socket before it starts the agent (pgherd_backup/walservice.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv curl \
    && rm -rf /var/lib/apt/lists/*

# Bytecode is compiled at install time: the containers run with a read-only root filesystem.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/pgherd/bin:$PATH

# scripts/install-pgherd.sh is the install tests/packaging/test_install.py runs and checks (the wheel,
# pinned by constraints.txt, no extras: the image runs the operator, the agent and the backup jobs, not
# the sandbox), from these same files: the image is what that test proved.
COPY pyproject.toml README.md constraints.txt /src/
COPY operator /src/operator
COPY backup /src/backup
COPY scripts/install-pgherd.sh /src/scripts/
RUN PIP_NO_CACHE_DIR=1 sh /src/scripts/install-pgherd.sh /src /opt/pgherd \
    && rm -rf /src

# Kubernetes sets the command of each container; this makes `docker run IMAGE pgherd-backup ...`,
# `docker run IMAGE pgherd ...` and `docker run IMAGE --help` (pgherd's options) work alike.
COPY --chmod=0755 <<'SH' /usr/local/bin/pgherd-entrypoint
#!/bin/sh
set -e
case "${1:-}" in
  pgherd|pgherd-backup) exec "$@" ;;
  ""|-*) exec pgherd "$@" ;;
  *) exec "$@" ;;
esac
SH

# The postgres user of the base image, by number: the kubelet can only enforce runAsNonRoot on a
# numeric user. The chart's podSecurityContext uses the same uid.
USER 999:999
WORKDIR /var/lib/postgresql
ENTRYPOINT ["pgherd-entrypoint"]
CMD ["pgherd", "--help"]
