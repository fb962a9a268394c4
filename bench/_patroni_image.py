"""The Patroni image of the localkube failover bench: bench/patroni/Dockerfile on the pgherd image that
`python -m e2e.localkube up` built (in podman's local storage), Patroni from PyPI, imported into the
cluster's containerd (namespace k8s.io, where pods find it with imagePullPolicy Never).

Cached: the tag is a hash of the Dockerfile, the base image's ID and Patroni's version, so the image
is built only when one of them changed (the older ones removed), and imported only when containerd does
not hold that tag.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from e2e.localkube.images import IMAGE_CACHE, ctr, import_archive
from e2e.localkube.settings import Layout

PATRONI_VERSION = "4.1.5"
CONTEXT = Path(__file__).resolve().parent / "patroni"
REPOSITORY = "localhost/pgherd-patroni"


class PatroniImageError(RuntimeError):
    pass


def _podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise PatroniImageError(
            f"`podman {' '.join(args)}` exited with {result.returncode}: {result.stderr.strip()}"
        )
    return result


def _pip_ca() -> str | None:
    """The CA bundle pip trusts on this host, as scripts/build-image.sh finds it: $PIP_CERT, else the
    `cert` of pip's configuration, else the system bundle."""
    found = os.environ.get("PIP_CERT")
    if not found:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
        )
        for line in listed.stdout.splitlines():
            key, _, value = line.partition("=")
            if key.endswith(".cert") and value:
                found = value.strip("'\"")
                break
    found = found or "/etc/ssl/certs/ca-certificates.crt"
    return found if Path(found).is_file() and Path(found).stat().st_size else None


def ensure_image(localkube_dir: Path, base: str, log: Callable[[str], None] = print) -> str:
    """The Patroni image's name in the cluster's containerd, built on `base` and imported if needed."""
    base_id = _podman("image", "inspect", "--format", "{{.Id}}", base, check=False).stdout.strip()
    if not base_id:
        raise PatroniImageError(
            f"the base image {base} is not in podman's storage: `python -m e2e.localkube up` builds it"
            " (scripts/build-image.sh)"
        )
    recipe = (CONTEXT / "Dockerfile").read_bytes() + f"\n{base_id}\n{PATRONI_VERSION}\n".encode()
    tag = f"{REPOSITORY}:{PATRONI_VERSION}-{hashlib.sha256(recipe).hexdigest()[:12]}"
    if _podman("image", "exists", tag, check=False).returncode != 0:
        log(f"building {tag} (Patroni {PATRONI_VERSION} from PyPI on {base})")
        ca = _pip_ca()
        _podman(
            "build", "--pull=never", "--layers",
            "--file", str(CONTEXT / "Dockerfile"),
            "--build-arg", f"BASE_IMAGE={base_id}",
            "--build-arg", f"PATRONI_VERSION={PATRONI_VERSION}",
            *(["--secret", f"id=pip-ca,src={ca}"] if ca else []),
            "--tag", tag, str(CONTEXT),
        )  # fmt: skip
        # The images of earlier inputs are never used again: only the newest is kept in podman.
        listed = _podman("images", "--format", "{{.Repository}}:{{.Tag}}", REPOSITORY, check=False)
        for old in set(listed.stdout.split()) - {tag}:
            _podman("rmi", old, check=False)
    layout = Layout(localkube_dir)
    if tag not in ctr(layout, "images", "list", "--quiet").split():
        # Written for the import alone (podman keeps the image): a cluster brought up again imports anew.
        IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
        archive = IMAGE_CACHE / f"{tag.rsplit('/', 1)[1].replace(':', '_')}.oci.tar"
        try:
            _podman("save", "--quiet", "--format", "oci-archive", "--output", str(archive), tag)
            log(f"importing {tag} into the containerd of {localkube_dir}")
            import_archive(layout, archive, tag)
        finally:
            archive.unlink(missing_ok=True)
    return tag
