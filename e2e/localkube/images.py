"""Images without a registry. The node's own (the pod sandbox: Debian's static catatonit in its pause
mode; a busybox image for local-path-provisioner's helper pods and for tests) are written here as OCI
archives from Debian's static binaries. The project's image is built from its Dockerfile by
scripts/build-image.sh into an OCI archive. Each archive is imported into containerd's `k8s.io`
namespace (the CRI's), where pods find it with imagePullPolicy Never or IfNotPresent."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

from e2e.localkube.binaries import host_tool
from e2e.localkube.settings import BUSYBOX_IMAGE, PAUSE_IMAGE, REPO, Layout

BUILD_IMAGE = REPO / "scripts" / "build-image.sh"
IMAGE_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pgherd" / "localkube"
BUSYBOX_APPLETS = (
    "sh", "ls", "cat", "echo", "mkdir", "rm", "rmdir", "chmod", "chown", "touch", "sleep", "wget", "nc",
    "httpd", "ps", "hostname", "ip", "id", "df", "du", "stat", "test", "true", "false", "nslookup",
)  # fmt: skip


class ImageError(RuntimeError):
    pass


def _blob(blobs: dict[str, bytes], data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return digest, len(data)


def _add_file(layer: tarfile.TarFile, name: str, data: bytes, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    layer.addfile(info, io.BytesIO(data))


def _add_link(layer: tarfile.TarFile, name: str, target: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, target, 0o777, 0
    layer.addfile(info)


def _add_dir(layer: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
    layer.addfile(info)


def write_oci_archive(
    path: Path, name: str, files: dict[str, bytes], links: dict[str, str], entrypoint: Sequence[str]
) -> None:
    """A one-layer OCI image archive of `files` (mode 0755) and symbolic `links`, named `name` by the
    annotation containerd's import reads."""
    layer_bytes = io.BytesIO()
    with tarfile.open(fileobj=layer_bytes, mode="w", format=tarfile.PAX_FORMAT) as layer:
        folders = sorted({str(Path(f).parent) for f in [*files, *links]} - {"."})
        for folder in folders:
            _add_dir(layer, folder)
        for file, data in sorted(files.items()):
            _add_file(layer, file, data)
        for link, target in sorted(links.items()):
            _add_link(layer, link, target)
    blobs: dict[str, bytes] = {}
    layer_digest, layer_size = _blob(blobs, layer_bytes.getvalue())
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": list(entrypoint), "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    config_digest, config_size = _blob(blobs, json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer_size,
            }
        ],
    }
    manifest_digest, manifest_size = _blob(blobs, json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                "annotations": {
                    "io.containerd.image.name": name,
                    "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                },
            }
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as archive:
        _add_file(archive, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}', 0o644)
        _add_file(archive, "index.json", json.dumps(index).encode(), 0o644)
        for digest, data in blobs.items():
            _add_file(archive, f"blobs/sha256/{digest.split(':')[1]}", data, 0o644)


def ctr(layout: Layout, *args: str) -> str:
    argv = [host_tool("ctr"), "--address", str(layout.containerd_socket), "-n", "k8s.io", *args]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ImageError(f"`{' '.join(argv)}` exited with {result.returncode}: {result.stderr.strip()}")
    return result.stdout


def import_archive(layout: Layout, archive: Path, name: str, *extra_names: str) -> None:
    """Import an OCI archive as `name` (its index kept under that name, whatever the archive's own
    annotations say), then give it `extra_names` too. Right after the archive was written anew,
    containerd 1.6 may refuse it, naming the digest of the archive's index.json ("content digest
    sha256:...: not found"): once it took the same file at the next attempt, once (2026-11-27) a minute
    later, once (2026-11-28) not within two minutes. Every other attempt therefore imports the image by
    the manifest the archive names (its ref.name annotation), which does not need the index as content,
    and tags it. Tried for up to about two minutes, waiting longer each time."""
    by_manifest = _annotated_name(archive)
    for attempt, delay in enumerate((2, 4, 8, 15, 30, 60, None)):
        plain = by_manifest is not None and attempt % 2 == 1
        try:
            if plain:
                ctr(layout, "images", "import", str(archive))
                if by_manifest != name:
                    ctr(layout, "images", "tag", "--force", str(by_manifest), name)
            else:
                ctr(layout, "images", "import", "--index-name", name, str(archive))
            break
        except ImageError as exc:
            if delay is None or "not found" not in str(exc):
                raise
            print(f"localkube: containerd refused the image ({exc}); again in {delay} s", flush=True)
            time.sleep(delay)
    for extra in extra_names:
        ctr(layout, "images", "tag", "--force", name, extra)


def _annotated_name(archive: Path) -> str | None:
    """The image name the archive's index gives its one manifest (org.opencontainers.image.ref.name),
    when it is a whole reference."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        index = json.load(member) if member is not None else {}
    manifests = index.get("manifests") or []
    annotations = (manifests[0].get("annotations") or {}) if len(manifests) == 1 else {}
    ref = annotations.get("org.opencontainers.image.ref.name")
    return str(ref) if ref and "/" in ref and ":" in ref else None


def node_images(layout: Layout) -> None:
    """The pause image and the busybox image, made from this machine's static binaries."""
    pause = layout.images / "pause.tar"
    write_oci_archive(
        pause,
        PAUSE_IMAGE,
        {"bin/catatonit": Path(host_tool("catatonit")).read_bytes()},
        {},
        ["/bin/catatonit", "-P"],
    )
    busybox = layout.images / "busybox.tar"
    write_oci_archive(
        busybox,
        BUSYBOX_IMAGE,
        {"bin/busybox": Path(host_tool("busybox")).read_bytes(), "www/index.html": b"hello from localkube\n"},
        {f"bin/{applet}": "busybox" for applet in BUSYBOX_APPLETS},
        ["/bin/sh"],
    )
    for archive in (pause, busybox):
        ctr(layout, "images", "import", str(archive))


def build_project_image(tag: str, postgres_major: int, extra_majors: str = "default") -> Path:
    """The project's image as an OCI archive, built by scripts/build-image.sh from the Dockerfile (under
    nice: it is the heaviest step; the script reuses its base and podman's layer cache, and rewrites the
    archive only when the image changed). The archive, in a cache outside DIR, names the image
    TAG-pg<major>."""
    if not BUILD_IMAGE.exists():
        raise ImageError(
            f"{BUILD_IMAGE.relative_to(REPO)} does not exist: pass --image-archive PATH (an OCI archive of "
            "the project's image) or --no-operator"
        )
    IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
    extras = "".join(f"-{m}" for m in extra_majors.split()) if extra_majors != "default" else "-all"
    archive = IMAGE_CACHE / f"pgherd-pg{postgres_major}{extras}.oci.tar"
    argv = [
        "nice", "-n", "10", "bash", str(BUILD_IMAGE), "--tag", tag, "--pg-major", str(postgres_major),
        "--extra-majors", extra_majors, "--oci-archive", str(archive),
    ]  # fmt: skip
    result = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0 or not archive.exists():
        raise ImageError(f"`{' '.join(argv)}` failed (exit {result.returncode}); see its output above")
    return archive
