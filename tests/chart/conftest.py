"""Fixtures of the chart's tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# e2e.* (the `pytest` script does not put the working directory on sys.path).
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def promtool() -> Path:
    """promtool built from Prometheus' Go module (scripts/ensure-prometheus.sh, run by `make setup-kube`)."""
    from e2e.localkube.prometheus_binaries import prometheus_bin

    folder = prometheus_bin()
    if folder is None:
        pytest.skip(
            "promtool is not built: run `make setup-kube` or scripts/ensure-prometheus.sh"
            " (builds it from Prometheus' Go module, about 3 minutes cold)"
        )
    return folder / "promtool"
