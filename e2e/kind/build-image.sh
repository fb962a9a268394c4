#!/usr/bin/env bash
# Build the pgherd image from the Dockerfile and load it into every node of the kind cluster, under
# two tags: PGHERD_E2E_IMAGE (default pgherd:e2e), which the operator Deployment and (the chart's
# default postgresImage) the PostgreSQL pods and Jobs run, and <PGHERD_E2E_IMAGE>-pg<major> (default
# pgherd:e2e-pg16) for a postgresImage with {major}. Both are the same image, built on PostgreSQL
# PGHERD_E2E_PG_VERSION with 17 beside it (the upgrade scenarios go from 16 to 17).
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

log "building $PGHERD_E2E_IMAGE and $MAJOR_IMAGE (PostgreSQL $PGHERD_E2E_PG_VERSION and 17)"
"$DOCKER" build \
  --build-arg "PG_MAJOR=$PGHERD_E2E_PG_VERSION" \
  --build-arg "PG_EXTRA_MAJORS=17" \
  --tag "$PGHERD_E2E_IMAGE" \
  --tag "$MAJOR_IMAGE" \
  "$REPO"

log "loading them into the nodes of $KIND_CLUSTER_NAME"
"$KIND" load docker-image --name "$KIND_CLUSTER_NAME" "$PGHERD_E2E_IMAGE" "$MAJOR_IMAGE"
