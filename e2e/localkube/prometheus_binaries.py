"""Where promtool and prometheus come from: scripts/ensure-prometheus.sh builds them from Prometheus' Go
module into a cache keyed by the pinned version (make setup-kube runs it; a cold build takes about
3 minutes on 2 cores), reused while the pin is unchanged."""

from __future__ import annotations

import subprocess
from pathlib import Path

from e2e.localkube.settings import REPO

ENSURE_PROMETHEUS = REPO / "scripts" / "ensure-prometheus.sh"


def prometheus_bin() -> Path | None:
    """The folder holding promtool and prometheus if they are built for the current pin, without
    building (the script's --check decides, so that the cache key lives in one place)."""
    result = subprocess.run(
        ["bash", str(ENSURE_PROMETHEUS), "--check"], cwd=REPO, capture_output=True, text=True, check=False
    )
    lines = result.stdout.strip().splitlines()
    return Path(lines[-1]) if result.returncode == 0 and lines else None
