#!/usr/bin/env bash
# Run the e2e scenarios on the kind cluster with the kind driver (e2e/drivers/kind.py). The driver
# installs the chart itself, once per session (helm upgrade --install pgherd charts/pgherd -n
# pgherd-system --wait, the operator image being PGHERD_E2E_IMAGE): this script does not.
#
#   e2e/kind/run-tests.sh [PYTEST ARGS...]     default: e2e -x
#   e2e/kind/run-tests.sh e2e/test_failover.py -s
#
# Run create-cluster.sh, build-image.sh and install-minio.sh first. The JUnit report goes to
# $PGHERD_E2E_ARTIFACTS/junit.xml; each scenario's applied manifests to $PGHERD_E2E_ARTIFACTS/workdirs
# (kept, with the cluster's namespace, when one of its tests failed).
# Settings (see lib.sh): KIND_CLUSTER_NAME, PGHERD_E2E_IMAGE, PGHERD_E2E_PG_VERSION,
# PGHERD_E2E_ARTIFACTS, MINIO_NAMESPACE, PGHERD_E2E_S3_BUCKET, PYTHON, KUBECTL, HELM.
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
. "$(dirname "$0")/lib.sh"
require "$PYTHON" "$KUBECTL"
resolve_helm
cluster_exists || die "kind cluster $KIND_CLUSTER_NAME does not exist: run e2e/kind/create-cluster.sh first"

export PGHERD_E2E_DRIVER=kind
export PGHERD_E2E_KUBE_CONTEXT="$KUBE_CONTEXT"
export PGHERD_E2E_S3_ENDPOINT="$S3_ENDPOINT"
export PGHERD_E2E_S3_SECRET="$MINIO_NAMESPACE/$S3_SECRET"
export PGHERD_E2E_WORKDIR="$PGHERD_E2E_ARTIFACTS/workdirs"
export KUBECTL
mkdir -p "$PGHERD_E2E_WORKDIR"

if [ $# -eq 0 ]; then
  set -- e2e -x
fi
cd "$REPO"
log "pytest $* (context $KUBE_CONTEXT, image $PGHERD_E2E_IMAGE, PostgreSQL $PGHERD_E2E_PG_VERSION)"
"$PYTHON" -m pytest --junitxml "$PGHERD_E2E_ARTIFACTS/junit.xml" "$@"
