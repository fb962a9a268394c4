"""`pgherd operator`: the Kubernetes operator (kopf underneath; see docs/kube.md).

    pgherd operator [--namespace NS ...| --all-namespaces] [--leader-elect] [--liveness URL] [--log-level L]
                    [--log-format text|json]

Credentials: in-cluster (the pod's ServiceAccount), else the current kubeconfig context. With
--leader-elect, only the holder of the Lease named by PGHERD_LEADER_ELECTION_LEASE (in POD_NAMESPACE)
acts; the others watch and wait to take over. POD_NAMESPACE and PGHERD_OPERATOR_POD_LABELS (a JSON
object, the chart's selector labels) say which pods the members' NetworkPolicy lets reach the agents.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from typing import TYPE_CHECKING

from pgherd_backup import logformat

if TYPE_CHECKING:
    from pgherd.kube.builders.networkpolicy import OperatorPods
    from pgherd.kube.handlers import Election
    from pgherd.kube.loop import OperatorConfig

LOG_LEVELS = ("debug", "info", "warning", "error")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "operator",
        help="run the Kubernetes operator",
        description="The pgherd operator: one loop per PostgresCluster, on kopf.",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], metavar="NS", help="serve this namespace (repeat)"
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="serve every namespace (the default)"
    )
    p.add_argument(
        "--leader-elect",
        action="store_true",
        help="act only while holding the Lease $PGHERD_LEADER_ELECTION_LEASE in $POD_NAMESPACE",
    )
    p.add_argument(
        "--liveness", metavar="URL", help="serve a health endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (default info)")
    p.add_argument(
        "--log-format",
        choices=logformat.FORMATS,
        default="text",
        help="text (default) or json: one object per line, kopf's too; the members' agents log alike",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9187,
        metavar="PORT",
        help="serve Prometheus metrics on this port, GET /metrics (default 9187; 0: none)",
    )
    p.add_argument(
        "--member-address",
        choices=("dns", "ip"),
        default=os.environ.get("PGHERD_MEMBER_ADDRESS") or "dns",
        help="how members reach each other: their DNS name through the headless Service (default) or pod IP",
    )
    p.set_defaults(func=main)


def election_from_env() -> Election:
    from pgherd.kube.handlers import Election

    lease = os.environ.get("PGHERD_LEADER_ELECTION_LEASE") or "pgherd-leader"
    namespace = os.environ.get("POD_NAMESPACE")
    if not namespace:
        try:
            with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as handle:
                namespace = handle.read().strip()
        except OSError:
            namespace = "default"
    identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    return Election(namespace=namespace, name=lease, identity=identity)


def operator_pods_from_env() -> OperatorPods | None:
    """The operator's own pods, as the chart describes them; None when run outside the chart."""
    from pgherd.kube.builders.networkpolicy import OperatorPods

    namespace = os.environ.get("POD_NAMESPACE")
    given = os.environ.get("PGHERD_OPERATOR_POD_LABELS")
    if not namespace or not given:
        logging.getLogger("pgherd.operator").warning(
            "POD_NAMESPACE or PGHERD_OPERATOR_POD_LABELS is not set (the chart sets both): the members'"
            " NetworkPolicy cannot name the operator's pods and leaves the agents' port 8008 open to every"
            " source (the agents still require the operator's token over TLS)"
        )
        return None
    labels = json.loads(given)
    if not isinstance(labels, dict) or not labels or not all(isinstance(v, str) for v in labels.values()):
        raise SystemExit(f"PGHERD_OPERATOR_POD_LABELS must be a JSON object of labels, not {given!r}")
    return OperatorPods(namespace=namespace, labels=labels)


def operator_config(args: argparse.Namespace) -> OperatorConfig:
    """What the loops need of the command line and the environment."""
    from pgherd.kube.loop import OperatorConfig

    return OperatorConfig(
        postgres_image=os.environ.get("PGHERD_POSTGRES_IMAGE") or "",
        member_address=args.member_address,
        operator_pods=operator_pods_from_env(),
        log_format=args.log_format,
    )


def main(args: argparse.Namespace) -> int:
    # Imported here: every `pgherd` command (the agent of each member, the sandbox's status) would
    # otherwise load kopf and the Kubernetes client at start-up, most of a second on a busy machine.
    from pgherd.kube.handlers import Operator, run

    logformat.configure(args.log_format, getattr(logging, args.log_level.upper()))
    for noisy in ("aiohttp.access", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    operator = Operator(
        config=operator_config(args),
        election=election_from_env() if args.leader_elect else None,
        freeze_heap=True,
    )
    if args.metrics_port:
        from pgherd.kube import metrics

        metrics.serve(args.metrics_port)
    run(
        operator,
        namespaces=args.namespace,
        clusterwide=not args.namespace,
        liveness=args.liveness,
    )
    return 0
