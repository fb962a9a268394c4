"""A change of `spec.postgresVersion` on a sandbox cluster: refused, for now.

A sandbox's PostgreSQL programs are fixed at `up` (sandbox.json): its data directories are that
major's, and the next major's server refuses them at best. Moving a cluster to another major takes a
major-version upgrade (pg_upgrade, or a new cluster restored from a dump), the MajorUpgrade operation
that issue 21 plans. Until the engine does it, `pgherd sandbox apply` refuses the change here, before the
manifest is stored, so that nothing ever starts the new major on the old data. This module is the one
place to replace when the upgrade exists.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class MajorChangeRefused(ValueError):
    """The manifest asks for another major than the cluster runs; the message says what to do."""


def requested_major(manifest: Mapping[str, Any]) -> int | None:
    """The major a PostgresCluster manifest asks for, the API's default when it names none; None when
    its postgresVersion is not an integer (admission refuses it, naming the field)."""
    from pgherd.api.cluster import PostgresClusterSpec

    spec = manifest.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    value = spec.get("postgresVersion", PostgresClusterSpec.model_fields["postgres_version"].default)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def refuse_major_change(running: int | None, manifest: Mapping[str, Any]) -> None:
    """MajorChangeRefused when ``manifest`` asks for another major than ``running`` (None: a sandbox
    from before the majors were recorded, whose major is unknown: nothing to compare)."""
    wanted = requested_major(manifest)
    if running is None or wanted is None or wanted == running:
        return
    spec = manifest.get("spec")
    named = isinstance(spec, Mapping) and "postgresVersion" in spec
    said = f"postgresVersion {wanted}" + ("" if named else " (the default: the manifest names none)")
    raise MajorChangeRefused(
        f"spec.postgresVersion: this cluster runs PostgreSQL {running} and the manifest says {said}; the"
        " sandbox does not upgrade a cluster to another major yet (its data directories are"
        f" PostgreSQL {running}'s): apply the manifest with postgresVersion: {running}, or make a new"
        " sandbox for the other major"
    )
