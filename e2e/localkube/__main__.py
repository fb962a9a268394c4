"""`python -m e2e.localkube up --dir DIR` / `down --dir DIR`: a real single-node Kubernetes on this
machine (see e2e/localkube/__init__.py and NOTES.md).

    up --dir DIR [--no-operator] [--prometheus] [--image-archive PATH] [--port-base N] [--keep-on-failure]
    down --dir DIR [--keep]          stop and remove everything `up` started; DIR too unless --keep
    status --dir DIR [--sample S]    the cluster's processes with their CPU and memory
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from e2e.localkube.settings import EXTRA_MAJORS, POSTGRES_MAJOR, PROJECT_IMAGE, Ports, Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.localkube",
        description="A real single-node Kubernetes on this machine (e2e/localkube/NOTES.md).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="start a cluster in DIR")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--no-operator", action="store_true", help="stop before the image and the chart")
    p.add_argument(
        "--image-archive", type=Path, help="an OCI archive of the project's image (default: build it)"
    )
    p.add_argument(
        "--image", default=PROJECT_IMAGE, help=f"the image's name in containerd (default {PROJECT_IMAGE})"
    )
    p.add_argument("--postgres-major", type=int, default=POSTGRES_MAJOR, help="the image's PostgreSQL major")
    p.add_argument(
        "--extra-majors",
        default=EXTRA_MAJORS,
        help=f"the other majors the image carries (default {EXTRA_MAJORS!r}: the upgrade scenarios' old"
        ' major; "default": the Dockerfile\'s own, every major)',
    )
    p.add_argument(
        "--port-base", type=int, default=Ports().base, help="first of the cluster's ports (default 20200)"
    )
    p.add_argument(
        "--keep-on-failure", action="store_true", help="leave a failed cluster running, to look at it"
    )
    p.add_argument(
        "--prometheus",
        action="store_true",
        help="also start Prometheus, scraping the members and the operator as the chart's PodMonitors"
        " would and evaluating its alerts (DIR/prometheus.json says where)",
    )
    p = sub.add_parser("down", help="stop the cluster in DIR and remove it")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--keep", action="store_true", help="keep DIR (logs, audit log, volumes)")
    p = sub.add_parser("status", help="the cluster's processes, CPU and memory")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--sample", type=float, default=10.0, help="seconds over which CPU is measured")
    args = parser.parse_args(argv)
    directory = args.dir.resolve()
    if args.command == "up":
        from e2e.localkube.up import Options, up

        options = Options(
            operator=not args.no_operator,
            image_archive=args.image_archive.resolve() if args.image_archive else None,
            image=args.image,
            postgres_major=args.postgres_major,
            extra_majors=args.extra_majors,
            keep_on_failure=args.keep_on_failure,
            prometheus=args.prometheus,
        )
        try:
            up(directory, Settings(ports=Ports(base=args.port_base)), options)
        except Exception as exc:
            print(f"localkube up failed: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.command == "down":
        from e2e.localkube.down import down

        return down(directory, keep=args.keep)
    from e2e.localkube.usage import status

    return status(directory, sample=args.sample)


if __name__ == "__main__":
    sys.exit(main())
