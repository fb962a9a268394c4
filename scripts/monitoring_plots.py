"""Draw docs/monitoring.md's pictures from a real Prometheus: the series of a failover and of a WAL
archiving outage, over the windows e2e/test_monitoring.py recorded in DIR/prometheus/scenarios.json,
read with Prometheus' query_range.

    python -m e2e.localkube up --dir DIR --prometheus
    PGHERD_E2E_DRIVER=localkube PGHERD_E2E_LOCALKUBE_DIR=DIR pytest e2e/test_monitoring.py
    pip install matplotlib   # a tool of the docs, not a dependency of pgherd or of its tests
    python scripts/monitoring_plots.py --dir DIR --out docs/img
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from e2e.monitoring import Prometheus  # noqa: E402

# Each scenario: panels of (title, PromQL with {sel} for the cluster's selector, legend label).
PANELS: dict[str, list[tuple[str, str, str]]] = {
    "failover": [
        (
            "pgherd_postgres_in_recovery (1: replica)",
            "max by (member) (pgherd_postgres_in_recovery{sel})",
            "member",
        ),
        ("pgherd_postgres_up", "max by (member) (pgherd_postgres_up{sel})", "member"),
        ("pgherd_timeline", "max by (member) (pgherd_timeline{sel})", "member"),
        ("ready members (operator)", "pgherd_cluster_ready_members{sel}", "cluster"),
        ("pgherd_failovers_total", "pgherd_failovers_total{sel}", "cluster"),
    ],
    "archiving": [
        (
            "segments waiting to be archived",
            "max by (member) (pgherd_wal_archive_pending_segments{sel})",
            "member",
        ),
        (
            "seconds since the last archived segment (members that archived)",
            "max by (member) (time() - (pgherd_wal_archive_last_success_timestamp_seconds{sel} > 0))",
            "member",
        ),
        (
            "archive failures (increase over 30 s)",
            "max by (member) (increase(pgherd_wal_archive_failures_total{sel}[30s]))",
            "member",
        ),
        (
            "PgherdWALArchivingFailing (compressed durations)",
            'ALERTS{{alertname="PgherdWALArchivingFailing",{inner}}}',
            "alertstate",
        ),
    ],
}


def draw(prometheus: Prometheus, name: str, window: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inner = f'namespace="{window["namespace"]}",cluster="{window["cluster"]}"'
    panels = PANELS[name]
    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 2.0 * len(panels)), sharex=True)
    start, end = float(window["start"]), float(window["end"])
    for axis, (title, template, legend) in zip(axes, panels, strict=True):
        expr = template.format(sel="{" + inner + "}", inner=inner)
        for series in prometheus.query_range(expr, start, end, step=2.0):
            xs = [float(t) - start for t, _ in series["values"]]
            ys = [float(v) for _, v in series["values"]]
            axis.step(xs, ys, where="post", label=series["metric"].get(legend, legend))
        axis.set_title(title, fontsize=9, loc="left")
        axis.legend(fontsize=7, loc="upper right")
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("seconds")
    when = datetime.fromtimestamp(start, UTC).strftime("%Y-%m-%d")
    figure.suptitle(f"{name}: {window['namespace']}/{window['cluster']}, localkube, {when}", fontsize=10)
    figure.tight_layout()
    path = out / f"monitoring-{name}.png"
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, required=True, help="the localkube cluster's DIR")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args()
    info = json.loads((args.dir / "prometheus.json").read_text())
    scenarios = json.loads((args.dir / "prometheus" / "scenarios.json").read_text())
    prometheus = Prometheus(info["url"])
    args.out.mkdir(parents=True, exist_ok=True)
    for name, window in scenarios.items():
        if name in PANELS:
            print(draw(prometheus, name, window, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
