#!/usr/bin/env bash
# Collect what explains a failed e2e run on kind into a directory: nodes, every object of the
# operator's, MinIO's and the scenarios' namespaces (get, describe), events, the PostgresClusters,
# Backups and Restores, the logs of every container of their pods (and of the previous instance of a
# restarted one), the Helm release, and kind's node logs (kubelet, containerd). Secrets' values are
# never written: no Secret is listed or described.
#
#   e2e/kind/collect-logs.sh [DIR]     default: $PGHERD_E2E_ARTIFACTS/logs
#
# Settings (see lib.sh): KIND_CLUSTER_NAME, PGHERD_E2E_ARTIFACTS, MINIO_NAMESPACE, KIND, KUBECTL, HELM.
# Nothing here stops at a failing command (the cluster may be half up): each failure is written into
# the file it was meant to fill, and the script always succeeds.
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
. "$(dirname "$0")/lib.sh"

dir=${1:-$PGHERD_E2E_ARTIFACTS/logs}
mkdir -p "$dir"
log "collecting logs into $dir"

# capture FILE COMMAND...: COMMAND's output into FILE; a failure is noted in it, not fatal.
capture() {
  local file=$1 status=0
  shift
  mkdir -p "$(dirname "$file")"
  "$@" >"$file" 2>&1 || status=$?
  if [ "$status" -ne 0 ]; then
    echo "(\`$*\` exited with $status)" >>"$file"
  fi
}

if ! cluster_exists; then
  echo "kind cluster $KIND_CLUSTER_NAME does not exist" >"$dir/README.txt"
  log "no cluster $KIND_CLUSTER_NAME: nothing to collect"
  exit 0
fi

capture "$dir/nodes.txt" kctl get nodes -o wide
capture "$dir/nodes-describe.txt" kctl describe nodes
capture "$dir/all.txt" kctl get all,pvc,pv,poddisruptionbudgets,leases -A -o wide
capture "$dir/events.txt" kctl get events -A --sort-by=.lastTimestamp
capture "$dir/pgherd-objects.yaml" kctl get postgresclusters.pgherd.io,backups.pgherd.io,restores.pgherd.io -A -o yaml
capture "$dir/crds.txt" kctl get customresourcedefinitions -o wide
# In a subshell: resolve_helm exits when it finds no helm, and this script must go on.
if HELM=$( (resolve_helm && printf '%s' "$HELM") 2>/dev/null); then
  capture "$dir/helm-status.txt" "$HELM" --kube-context "$KUBE_CONTEXT" -n "$OPERATOR_NAMESPACE" status "$RELEASE"
  capture "$dir/helm-values.yaml" "$HELM" --kube-context "$KUBE_CONTEXT" -n "$OPERATOR_NAMESPACE" get values --all "$RELEASE"
fi

namespaces=("$OPERATOR_NAMESPACE" "$MINIO_NAMESPACE")
# The scenarios' namespaces (pgherd-e2e-<cluster>) that are still there: those of failed modules.
for ns in $(kctl get namespaces -o jsonpath='{.items[*].metadata.name}' 2>/dev/null || true); do
  case "$ns" in
    pgherd-e2e-*) namespaces+=("$ns") ;;
  esac
done

for ns in "${namespaces[@]}"; do
  out="$dir/namespaces/$ns"
  mkdir -p "$out"
  kinds=statefulsets,deployments,jobs,pods,services,endpoints,configmaps,persistentvolumeclaims,poddisruptionbudgets,leases
  capture "$out/get.txt" kctl -n "$ns" get "$kinds" -o wide
  capture "$out/objects.yaml" kctl -n "$ns" get "$kinds" -o yaml
  capture "$out/describe.txt" kctl -n "$ns" describe statefulsets,deployments,jobs,pods,persistentvolumeclaims
  capture "$out/events.txt" kctl -n "$ns" get events --sort-by=.lastTimestamp
  for pod in $(kctl -n "$ns" get pods -o jsonpath='{.items[*].metadata.name}' 2>/dev/null || true); do
    containers=$(kctl -n "$ns" get pod "$pod" \
      -o jsonpath='{.spec.initContainers[*].name} {.spec.containers[*].name}' 2>/dev/null || true)
    for container in $containers; do
      capture "$out/logs/$pod.$container.log" kctl -n "$ns" logs "$pod" -c "$container" --timestamps
      restarts=$(kctl -n "$ns" get pod "$pod" \
        -o jsonpath="{.status.containerStatuses[?(@.name==\"$container\")].restartCount}" 2>/dev/null || true)
      if [ -n "$restarts" ] && [ "$restarts" != 0 ]; then
        capture "$out/logs/$pod.$container.previous.log" \
          kctl -n "$ns" logs "$pod" -c "$container" --timestamps --previous
      fi
    done
  done
done

capture "$dir/kind-export.txt" "$KIND" export logs "$dir/kind" --name "$KIND_CLUSTER_NAME"
log "logs collected in $dir"
