"""The sandbox's object store: what the Kubernetes API server does for pgherd's kinds, in files.

Manifests are admitted exactly as the API server would (`pgherd.api.admission`: schema, defaults, CEL
rules with the stored object for transition rules), spec changes bump `metadata.generation`, and the
status is written apart from the spec, as through the status subresource.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from pgherd.local.layout import SandboxPaths, read_json, write_json
from pgherd_backup.timestamps import now_rfc3339


def _status_of(stored: dict[str, Any] | None) -> dict[str, Any]:
    return {"status": stored["status"]} if stored is not None and "status" in stored else {}


def _admit(manifest: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
    """pgherd.api.admission's admit, imported on first use: reading the stored objects (`pgherd sandbox
    status`, which scripts poll) needs neither pydantic nor CEL, most of that command's start-up."""
    from pgherd.api.admission import admit

    return admit(manifest, old=old)


def now_iso() -> str:
    return now_rfc3339()


class ObjectStore:
    def __init__(self, paths: SandboxPaths) -> None:
        self.paths = paths

    # --- PostgresCluster -------------------------------------------------------------------------
    def cluster(self) -> dict[str, Any]:
        data: dict[str, Any] | None = read_json(self.paths.cluster_object)
        if data is None:
            raise FileNotFoundError(f"no PostgresCluster in {self.paths.root}")
        return data

    def apply(self, manifest: dict[str, Any]) -> str:
        """Admit and store a manifest of any pgherd kind; returns what happened, kubectl-style."""
        kind = manifest.get("kind")
        if kind == "PostgresCluster":
            return self._apply_cluster(manifest)
        if kind in ("Backup", "Restore"):
            return self._apply_child(manifest)
        _admit(manifest)  # raises ManifestRefused naming the kind
        raise AssertionError("unreachable")

    def _apply_cluster(self, manifest: dict[str, Any]) -> str:
        stored: dict[str, Any] | None = read_json(self.paths.cluster_object)
        old = None if stored is None else {k: v for k, v in stored.items() if k != "status"}
        admitted = _admit(manifest, old=old)
        name = admitted["metadata"]["name"]
        if stored is not None and stored["metadata"]["name"] != name:
            raise ValueError(
                f"this sandbox runs PostgresCluster {stored['metadata']['name']!r}, not {name!r}:"
                " use another --dir for another cluster"
            )
        metadata = {"name": name, "generation": 1, "creationTimestamp": now_iso()}
        given = (manifest.get("metadata") or {}).get("annotations") or {}
        if stored is not None:
            metadata = dict(stored["metadata"])
            noted = {**(metadata.get("annotations") or {}), **given}
            if stored.get("spec") == admitted.get("spec") and noted == (metadata.get("annotations") or {}):
                return f"postgrescluster.pgherd.io/{name} unchanged"
            if stored.get("spec") != admitted.get("spec"):
                metadata["generation"] = int(metadata.get("generation", 1)) + 1
            given = noted
        if given:
            metadata["annotations"] = {str(k): str(v) for k, v in given.items()}
        write_json(self.paths.cluster_object, {**admitted, "metadata": metadata, **_status_of(stored)})
        return f"postgrescluster.pgherd.io/{name} {'configured' if stored else 'created'}"

    def annotate(self, key: str, value: str | None) -> str:
        """Set (or with None remove) an annotation of the cluster, as `kubectl annotate` does: the spec
        and its generation stay as they are."""
        stored: dict[str, Any] | None = read_json(self.paths.cluster_object)
        if stored is None:
            raise ValueError("no PostgresCluster in this sandbox yet")
        metadata = dict(stored["metadata"])
        annotations = dict(metadata.get("annotations") or {})
        if value is None:
            annotations.pop(key, None)
        else:
            annotations[key] = value
        metadata["annotations"] = annotations
        write_json(self.paths.cluster_object, {**stored, "metadata": metadata})
        return f"postgrescluster.pgherd.io/{metadata['name']} annotated"

    def _child_path(self, kind: str, name: str) -> Path:
        folder = self.paths.backups if kind == "Backup" else self.paths.restores
        return folder / f"{name}.json"

    def _apply_child(self, manifest: dict[str, Any]) -> str:
        kind = str(manifest["kind"])
        name = str((manifest.get("metadata") or {}).get("name", ""))
        path = self._child_path(kind, name) if name else None
        stored: dict[str, Any] | None = read_json(path) if path else None
        old = None if stored is None else {k: v for k, v in stored.items() if k != "status"}
        admitted = _admit(manifest, old=old)
        cluster = self.cluster()["metadata"]["name"]
        if admitted["spec"]["cluster"]["name"] != cluster:
            raise ValueError(
                f"{kind} {name!r} is for cluster {admitted['spec']['cluster']['name']!r}; this sandbox runs {cluster!r}"
            )
        assert path is not None
        if stored is not None:
            return f"{kind.lower()}.pgherd.io/{name} unchanged"
        metadata = {"name": name, "creationTimestamp": now_iso()}
        write_json(path, {**admitted, "metadata": metadata, "status": {"phase": "Pending"}})
        return f"{kind.lower()}.pgherd.io/{name} created"

    def create_backup(self, name: str) -> None:
        """A scheduled Backup, created by the operator itself."""
        path = self._child_path("Backup", name)
        if path.exists():
            return
        manifest = {
            "apiVersion": "pgherd.io/v1alpha1",
            "kind": "Backup",
            "metadata": {"name": name},
            "spec": {"cluster": {"name": self.cluster()["metadata"]["name"]}},
        }
        self._apply_child(manifest)

    # --- Backups and Restores ---------------------------------------------------------------------
    def _list(self, folder: Path) -> list[dict[str, Any]]:
        if not folder.is_dir():
            return []
        items = [read_json(p) for p in sorted(folder.glob("*.json"))]
        return sorted(
            (i for i in items if i), key=lambda i: (i["metadata"]["creationTimestamp"], i["metadata"]["name"])
        )

    def backups(self) -> list[dict[str, Any]]:
        return self._list(self.paths.backups)

    def restores(self) -> list[dict[str, Any]]:
        return self._list(self.paths.restores)

    def backup(self, name: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = read_json(self._child_path("Backup", name))
        return found

    def update_status(self, kind: str, name: str, **fields: Any) -> None:
        path = self._child_path(kind, name)
        stored: dict[str, Any] | None = read_json(path)
        if stored is None:
            return
        status = dict(stored.get("status") or {})
        status.update({k: v for k, v in fields.items() if v is not None})
        if status != stored.get("status"):
            write_json(path, {**stored, "status": status})

    # --- switchover requests (the pgherd.io/switchover-to annotation on Kubernetes) -----------------
    def request_switchover(self, to: str | None) -> str:
        """Ask for a switchover; returns the request's id, which its result carries."""
        request_id = secrets.token_hex(6)
        write_json(self.paths.switchover_request, {"to": to, "requestedAt": now_iso(), "id": request_id})
        return request_id

    def switchover_request(self) -> dict[str, Any] | None:
        found: dict[str, Any] | None = read_json(self.paths.switchover_request)
        return found

    def clear_switchover(self) -> None:
        self.paths.switchover_request.unlink(missing_ok=True)
