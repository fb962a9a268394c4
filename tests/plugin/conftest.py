"""The real API server's fixtures (tests/kube/conftest.py: `control_plane`, `kube`, `namespace`, ...),
for the plugin's tests against it."""

from __future__ import annotations

from kube.conftest import audit, control_plane, kube, namespace

__all__ = ["audit", "control_plane", "kube", "namespace"]
