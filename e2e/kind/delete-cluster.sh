#!/usr/bin/env bash
# Delete the kind cluster of the e2e scenarios, if it exists (everything in it goes with it: the
# operator, MinIO and the clusters' volumes).
#
#   e2e/kind/delete-cluster.sh
#
# Settings (see lib.sh): KIND_CLUSTER_NAME (default pgherd-e2e), KIND.
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
. "$(dirname "$0")/lib.sh"
require "$KIND"

if cluster_exists; then
  log "deleting kind cluster $KIND_CLUSTER_NAME"
  "$KIND" delete cluster --name "$KIND_CLUSTER_NAME"
else
  log "kind cluster $KIND_CLUSTER_NAME does not exist: nothing to delete"
fi
