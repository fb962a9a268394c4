#!/usr/bin/env bash
# Build the pgherd image from the Dockerfile and load it into every node of the kind cluster, under
# two tags: PGHERD_E2E_IMAGE (default pgherd:e2e), which the operator Deployment runs, and
# <PGHERD_E2E_IMAGE>-pg<PGHERD_E2E_PG_VERSION> (default pgherd:e2e-pg16), which the chart's default
# postgresImage (<repository>:<tag>-pg{major}) gives the PostgreSQL pods and Jobs of a cluster with
# that postgresVersion. Both are the same image, built on PostgreSQL PGHERD_E2E_PG_VERSION.
#
#   e2e/kind/build-image.sh
#
# Settings (see lib.sh): PGHERD_E2E_IMAGE, PGHERD_E2E_PG_VERSION, KIND_CLUSTER_NAME, DOCKER, KIND.
# Running it again rebuilds from Docker's cache and loads only what changed.
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
. "$(dirname "$0")/lib.sh"
require "$DOCKER" "$KIND"
cluster_exists || die "kind cluster $KIND_CLUSTER_NAME does not exist: run e2e/kind/create-cluster.sh first"

log "building $PGHERD_E2E_IMAGE and $POSTGRES_IMAGE (PostgreSQL $PGHERD_E2E_PG_VERSION)"
"$DOCKER" build \
  --build-arg "PG_MAJOR=$PGHERD_E2E_PG_VERSION" \
  --tag "$PGHERD_E2E_IMAGE" \
  --tag "$POSTGRES_IMAGE" \
  "$REPO"

log "loading them into the nodes of $KIND_CLUSTER_NAME"
"$KIND" load docker-image --name "$KIND_CLUSTER_NAME" "$PGHERD_E2E_IMAGE" "$POSTGRES_IMAGE"
