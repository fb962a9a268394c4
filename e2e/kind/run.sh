#!/usr/bin/env bash
# The e2e scenarios on a fresh kind cluster, from nothing to a report: create the cluster
# (create-cluster.sh), build the pgherd image and load it (build-image.sh), install MinIO and its
# bucket (install-minio.sh), run the scenarios with the kind driver, which installs the chart
# (run-tests.sh), collect the logs when something failed (collect-logs.sh) and delete the cluster
# (delete-cluster.sh).
#
#   e2e/kind/run.sh [PYTEST ARGS...]                   default: e2e -x
#   e2e/kind/run.sh e2e/test_failover.py -s
#   KEEP_CLUSTER=1 e2e/kind/run.sh                     keep the cluster afterwards, to look or rerun
#
# Every step is idempotent: with KEEP_CLUSTER=1, a second run reuses the cluster, MinIO and its keys.
# Needs docker, kind, kubectl, and the repository's virtualenv (`make setup`, or at least
# `make .venv/.installed`); helm comes from PATH or from .tools/bin (scripts/ensure-helm.sh).
# Settings: see lib.sh. Logs and the JUnit report: $PGHERD_E2E_ARTIFACTS (default <repo>/.e2e-kind).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=e2e/kind/lib.sh
. "$here/lib.sh"

finish() {
  local status=$?
  if [ "$status" -ne 0 ]; then
    log "failed (exit $status): collecting logs"
    "$here/collect-logs.sh" || log "collecting logs failed"
  fi
  if [ "${KEEP_CLUSTER:-0}" = 1 ]; then
    log "keeping kind cluster $KIND_CLUSTER_NAME (context $KUBE_CONTEXT)"
  else
    "$here/delete-cluster.sh" || log "deleting the cluster failed"
  fi
  exit "$status"
}
trap finish EXIT

# A previous run's report and logs would be taken for this one's: remove them (only them).
rm -rf "$PGHERD_E2E_ARTIFACTS/logs" "$PGHERD_E2E_ARTIFACTS/workdirs" "$PGHERD_E2E_ARTIFACTS/junit.xml"
mkdir -p "$PGHERD_E2E_ARTIFACTS"
"$here/create-cluster.sh"
"$here/build-image.sh"
"$here/install-minio.sh"
"$here/run-tests.sh" "$@"
