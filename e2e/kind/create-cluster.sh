#!/usr/bin/env bash
# Create the three-node kind cluster of the e2e scenarios (kind-config.yaml), unless it exists, and
# make its control plane schedulable, so that the three nodes all take member pods.
#
#   e2e/kind/create-cluster.sh
#
# Settings (see lib.sh): KIND_CLUSTER_NAME (default pgherd-e2e), KIND_NODE_IMAGE, KIND, KUBECTL.
# Running it again on an existing cluster only checks that its nodes are Ready.
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
. "$(dirname "$0")/lib.sh"
require "$KIND" "$KUBECTL"

if cluster_exists; then
  log "kind cluster $KIND_CLUSTER_NAME exists: reusing it"
else
  args=(create cluster --name "$KIND_CLUSTER_NAME" --config "$KIND_DIR/kind-config.yaml" --wait 180s)
  if [ -n "${KIND_NODE_IMAGE:-}" ]; then
    args+=(--image "$KIND_NODE_IMAGE")
  fi
  log "creating kind cluster $KIND_CLUSTER_NAME"
  "$KIND" "${args[@]}"
fi

taint="node-role.kubernetes.io/control-plane"
for node in $(kctl get nodes -l "$taint" -o jsonpath='{.items[*].metadata.name}'); do
  taints=" $(kctl get node "$node" -o jsonpath='{.spec.taints[*].key}') "
  if [[ $taints == *" $taint "* ]]; then
    log "making $node schedulable"
    kctl taint node "$node" "$taint:NoSchedule-"
  fi
done

kctl wait --for=condition=Ready nodes --all --timeout=180s
kctl get nodes -o wide
