#!/usr/bin/env bash
# Install MinIO (minio.yaml: one Deployment and its Service, no operator) into the kind cluster, the
# Secret of its keys, and its bucket (minio-bucket-job.yaml). The kind driver copies that Secret into
# each scenario's namespace and gives every PostgresCluster this store (PGHERD_E2E_S3_*, set by
# run-tests.sh), so that Backups and Restores run against it.
#
#   e2e/kind/install-minio.sh
#
# Run it after build-image.sh: the bucket Job runs the pgherd image (it has boto3).
# Settings (see lib.sh): MINIO_NAMESPACE (default pgherd-minio), MINIO_IMAGE, PGHERD_E2E_S3_BUCKET,
# PGHERD_E2E_IMAGE, KIND_CLUSTER_NAME, KUBECTL.
# Running it again keeps the keys (the Secret is created once) and the bucket's contents.
set -euo pipefail
# shellcheck source=e2e/kind/lib.sh
. "$(dirname "$0")/lib.sh"
require "$KUBECTL"

# render FILE: the manifest with its @PLACEHOLDERS@ replaced.
render() {
  sed \
    -e "s|@MINIO_IMAGE@|$MINIO_IMAGE|g" \
    -e "s|@PGHERD_IMAGE@|$PGHERD_E2E_IMAGE|g" \
    -e "s|@S3_SECRET@|$S3_SECRET|g" \
    -e "s|@S3_ENDPOINT@|$S3_ENDPOINT|g" \
    -e "s|@S3_BUCKET@|$PGHERD_E2E_S3_BUCKET|g" \
    "$KIND_DIR/$1"
}

# random_key: 32 hexadecimal characters.
random_key() {
  od -An -tx1 -N16 /dev/urandom | tr -d ' \n'
}

kctl create namespace "$MINIO_NAMESPACE" --dry-run=client -o yaml | kctl apply -f -

if kctl -n "$MINIO_NAMESPACE" get secret "$S3_SECRET" >/dev/null 2>&1; then
  log "secret $MINIO_NAMESPACE/$S3_SECRET exists: keeping its keys"
else
  log "creating secret $MINIO_NAMESPACE/$S3_SECRET"
  # The keys go through files that only this user can read, never through a command line.
  keys=$(mktemp -d)
  trap 'rm -rf "$keys"' EXIT
  access="pgherd$(random_key | cut -c1-10)"
  secret=$(random_key)
  (umask 077 && printf '%s' "$access" >"$keys/AWS_ACCESS_KEY_ID" && printf '%s' "$secret" >"$keys/AWS_SECRET_ACCESS_KEY")
  kctl -n "$MINIO_NAMESPACE" create secret generic "$S3_SECRET" \
    --from-file="$keys/AWS_ACCESS_KEY_ID" --from-file="$keys/AWS_SECRET_ACCESS_KEY"
fi

log "installing MinIO ($MINIO_IMAGE) in $MINIO_NAMESPACE"
render minio.yaml | kctl -n "$MINIO_NAMESPACE" apply -f -
kctl -n "$MINIO_NAMESPACE" rollout status deployment/minio --timeout=300s

log "creating bucket $PGHERD_E2E_S3_BUCKET"
kctl -n "$MINIO_NAMESPACE" delete job minio-bucket --ignore-not-found --wait=true
render minio-bucket-job.yaml | kctl -n "$MINIO_NAMESPACE" apply -f -
if ! kctl -n "$MINIO_NAMESPACE" wait --for=condition=complete job/minio-bucket --timeout=300s; then
  kctl -n "$MINIO_NAMESPACE" logs job/minio-bucket --all-containers --tail=50 >&2 || true
  die "the bucket Job did not complete"
fi
kctl -n "$MINIO_NAMESPACE" logs job/minio-bucket --tail=5
