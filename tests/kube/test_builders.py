"""The pure builders of the Kubernetes adapter (pgherd.kube.builders): every object validates against
the official schemas of Kubernetes 1.30 and 1.33, and what matters holds — ownership, the StatefulSet's
policies, probes, the restricted Pod Security Standard, the agent's configuration as its real parser
reads it, secrets that stay in Secrets, the budget's majority, selectors, and Jobs whose commands
pgherd-backup's real parser accepts."""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import inspect
import json
import math
import os
import ssl
import string
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from psycopg.conninfo import conninfo_to_dict

from pgherd.api.cluster import MAX_INSTANCES, PostgresClusterSpec, VolumeDeletePolicy
from pgherd.commands import instance as instance_command
from pgherd.engine.revision import spec_revision
from pgherd.kube import names
from pgherd.kube.builders import configmap as cm
from pgherd.kube.builders import jobs, networkpolicy, pdb, secrets, serviceaccount, services, statefulset
from pgherd.kube.builders.common import ClusterRef, resolve_image
from pgherd.kube.builders.networkpolicy import OperatorPods
from pgherd_backup import cli as backup_cli
from pgherd_backup.agent.auth import Verdict, check_bearer
from pgherd_backup.agent.options import METRICS_PORT as AGENT_METRICS_PORT
from pgherd_backup.agent.options import AgentOptions, read_parameters
from pgherd_backup.agent.tls import client_context, server_context
from pgherd_backup.postgres.parameters import replication_timing
from pgherd_backup.store import S3Settings

VERSIONS = ("1.30", "1.33")
NAMESPACE = "shop"
UID = "0b6c2a4e-5f0e-4c1d-9a57-3d7c1f0e8a11"

FULL_SPEC: dict[str, Any] = {
    "instances": 3,
    "postgresVersion": 17,
    "storage": {"size": "20Gi", "storageClassName": "fast-ssd"},
    "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    "parameters": {
        "max_connections": "200",
        "search_path": "'$user', public",
        "log_line_prefix": "%m [%p] # ",
        "default_text_search_config": "pg_catalog.english",
    },
    "bootstrap": {"initdb": {"database": "orders", "owner": "shopper"}},
    "backup": {
        "store": {
            "s3": {
                "bucket": "pg-backups",
                "path": "prod/",
                "endpoint": "https://minio.storage.svc:9000",
                "region": "eu-west-1",
                "forcePathStyle": True,
                "credentials": {"secretName": "s3-credentials"},
            }
        },
        "schedule": "0 3 * * *",
        "retention": {"keepLast": 7, "keepWithin": "14d"},
        "compression": "lz4",
    },
    "networkPolicy": {
        "clients": [
            {
                "namespaceSelector": {"matchLabels": {"team": "shop"}},
                "podSelector": {"matchLabels": {"app": "web"}},
            },
            {
                "podSelector": {
                    "matchExpressions": [{"key": "tier", "operator": "In", "values": ["api", "batch"]}]
                }
            },
            {"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.9.0/24"]}},
        ]
    },
}
MINIMAL_SPEC: dict[str, Any] = {"instances": 1}
# The chart's operator: its namespace and its Deployment's selector labels.
OPERATOR = OperatorPods(
    "pgherd-system",
    {
        "app.kubernetes.io/name": "pgherd",
        "app.kubernetes.io/instance": "pgherd",
        "app.kubernetes.io/component": "operator",
    },
)


def make_ref(spec: Mapping[str, Any], name: str = "demo") -> ClusterRef:
    model = PostgresClusterSpec.model_validate(spec)
    image = resolve_image(model, "ghcr.io/pgherd/pgherd:0.1.0-pg{major}", "ghcr.io/pgherd/pgherd:0.1.0")
    return ClusterRef(name, NAMESPACE, UID, model, image, spec_revision(model))


@pytest.fixture(scope="module")
def full() -> ClusterRef:
    return make_ref(FULL_SPEC)


@pytest.fixture(scope="module")
def minimal() -> ClusterRef:
    return make_ref(MINIMAL_SPEC, name="solo")


@pytest.fixture(scope="module")
def operator_data(full: ClusterRef) -> dict[str, str]:
    return secrets.generate_operator_data(full.name)


@pytest.fixture(scope="module")
def secret_data(full: ClusterRef, operator_data: dict[str, str]) -> dict[str, dict[str, str]]:
    return {
        "superuser": secrets.generate_superuser_data(),
        "replication": secrets.generate_replication_data(),
        "app": secrets.generate_app_data(full, operator_data["ca.crt"]),
        "agent": secrets.generate_agent_data(full.name, full.namespace, operator_data),
        "operator": operator_data,
    }


def secret_objects(ref: ClusterRef, data: Mapping[str, Mapping[str, str]]) -> list[dict[str, Any]]:
    return [
        secrets.superuser_secret(ref, data["superuser"]),
        secrets.replication_secret(ref, data["replication"]),
        secrets.app_secret(ref, data["app"]),
        secrets.agent_secret(ref, data["agent"]),
        secrets.operator_secret(ref, data["operator"]),
    ]


def non_secret_objects(ref: ClusterRef) -> list[dict[str, Any]]:
    objects = [
        statefulset.statefulset(ref),
        *services.services(ref),
        cm.configmap(ref),
        serviceaccount.service_account(ref),
    ]
    budget = pdb.pdb(ref)
    if budget is not None:
        objects.append(budget)
    policy = networkpolicy.network_policy(ref, OPERATOR)
    if policy is not None:
        objects.append(policy)
    if ref.spec.backup is not None and ref.spec.backup.store is not None:
        objects.append(jobs.snapshot_job(ref, "demo-nightly", "10.1.2.3", backup_uid=UID))
        objects.append(jobs.prune_job(ref, "20250131t030000", 7, "14d"))
    return objects


def all_objects(ref: ClusterRef, data: Mapping[str, Mapping[str, str]]) -> list[dict[str, Any]]:
    return [*non_secret_objects(ref), *secret_objects(ref, data)]


def minimal_data(ref: ClusterRef, operator_data: dict[str, str]) -> dict[str, dict[str, str]]:
    return {
        "superuser": secrets.generate_superuser_data(),
        "replication": secrets.generate_replication_data(),
        "app": secrets.generate_app_data(ref, operator_data["ca.crt"]),
        "agent": secrets.generate_agent_data(ref.name, ref.namespace, operator_data),
        "operator": operator_data,
    }


def pod_specs(ref: ClusterRef) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in non_secret_objects(ref):
        if obj["kind"] in ("StatefulSet", "Job"):
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]


def container(ref: ClusterRef) -> dict[str, Any]:
    containers: list[dict[str, Any]] = statefulset.statefulset(ref)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


# --- schemas -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_strictly(version: str, full: ClusterRef, minimal: ClusterRef, secret_data):
    solo_data = minimal_data(minimal, secrets.generate_operator_data(minimal.name))
    objects = [*all_objects(full, secret_data), *all_objects(minimal, solo_data)]
    kinds = {obj["kind"] for obj in objects}
    assert kinds == {
        "StatefulSet",
        "Service",
        "ConfigMap",
        "ServiceAccount",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Job",
        "Secret",
    }
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_a_bad_object_does_not_validate(full: ClusterRef):
    """The schema check has teeth: a misspelt field fails strict validation."""
    broken = statefulset.statefulset(full)
    broken["spec"]["updateStrategy"] = {"kind": "OnDelete"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.33", strict=True)


# --- ownership and labels ----------------------------------------------------------------------------


def test_every_object_is_owned_by_its_cluster_and_labelled(full: ClusterRef, secret_data):
    for obj in all_objects(full, secret_data):
        meta = obj["metadata"]
        what = f"{obj['kind']} {meta['name']}"
        assert meta["namespace"] == NAMESPACE, what
        assert meta["labels"][names.LABEL_CLUSTER] == "demo", what
        controllers = [o for o in meta["ownerReferences"] if o.get("controller")]
        assert controllers == [
            {
                "apiVersion": "pgherd.io/v1alpha1",
                "kind": "PostgresCluster",
                "name": "demo",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ], what
        template = obj.get("spec", {}).get("template")
        if template is not None:
            assert template["metadata"]["labels"][names.LABEL_CLUSTER] == "demo", what


def test_the_snapshot_job_is_also_owned_by_its_backup(full: ClusterRef):
    job = jobs.snapshot_job(full, "nightly", "10.0.0.7", backup_uid="b-uid")
    owners = job["metadata"]["ownerReferences"]
    assert [(o["kind"], o["controller"]) for o in owners] == [("PostgresCluster", True), ("Backup", False)]
    assert owners[1]["name"] == "nightly" and owners[1]["uid"] == "b-uid"
    no_backup_owner = jobs.snapshot_job(full, "nightly", "10.0.0.7")
    assert len(no_backup_owner["metadata"]["ownerReferences"]) == 1


def test_object_names_follow_names_py(full: ClusterRef, secret_data):
    got = {(o["kind"], o["metadata"]["name"]) for o in all_objects(full, secret_data)}
    assert got == {
        ("StatefulSet", "demo"),
        ("Service", "demo-rw"),
        ("Service", "demo-ro"),
        ("Service", "demo-r"),
        ("Service", "demo-headless"),
        ("ConfigMap", "demo-config"),
        ("ServiceAccount", "demo-postgres"),
        ("PodDisruptionBudget", "demo"),
        ("NetworkPolicy", "demo"),
        ("Job", "demo-nightly-snapshot"),
        ("Job", "demo-prune-20250131t030000"),
        ("Secret", "demo-superuser"),
        ("Secret", "demo-replication"),
        ("Secret", "demo-app"),
        ("Secret", "demo-agent"),
        ("Secret", "demo-operator"),
    }


# --- the StatefulSet ---------------------------------------------------------------------------------


def test_statefulset_policies(full: ClusterRef):
    sts = statefulset.statefulset(full)
    spec = sts["spec"]
    assert spec["updateStrategy"] == {"type": "OnDelete"}
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    assert spec["serviceName"] == "demo-headless"
    assert spec["replicas"] == 3
    assert statefulset.statefulset(full, replicas=4)["spec"]["replicas"] == 4
    assert spec["selector"] == {"matchLabels": names.selector_labels("demo")}
    template = spec["template"]
    labels = template["metadata"]["labels"]
    assert names.selector_labels("demo").items() <= labels.items()
    assert names.LABEL_ROLE not in labels  # the operator alone labels the primary
    assert labels[names.LABEL_REVISION] == full.revision == spec_revision(full.spec)
    assert template["metadata"]["annotations"][names.ANNOTATION_REVISION] == full.revision
    pod = template["spec"]
    assert pod["serviceAccountName"] == "demo-postgres"
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"] == {
        "labelSelector": {"matchLabels": names.selector_labels("demo")},
        "topologyKey": "kubernetes.io/hostname",
    }
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["podAntiAffinity"]


def test_the_container_runs_the_agent(full: ClusterRef):
    c = container(full)
    assert c["name"] == names.CONTAINER_POSTGRES
    assert c["image"] == "ghcr.io/pgherd/pgherd:0.1.0-pg17"
    assert c["command"] == ["pgherd", "instance", "run"]
    assert "args" not in c
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "postgres": 5432,
        "agent": 8008,
        "metrics": 9187,
    }
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}


def test_volume_claim_template(full: ClusterRef, minimal: ClusterRef):
    (claim,) = statefulset.statefulset(full)["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == names.VOLUME_DATA
    assert claim["metadata"]["labels"][names.LABEL_CLUSTER] == "demo"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "20Gi"}},
        "storageClassName": "fast-ssd",
    }
    (solo,) = statefulset.statefulset(minimal)["spec"]["volumeClaimTemplates"]
    assert "storageClassName" not in solo["spec"]  # the cluster's default StorageClass
    mounts = {m["name"]: m["mountPath"] for m in container(full)["volumeMounts"]}
    assert mounts[names.VOLUME_DATA] == names.DATA_MOUNT
    assert names.PGDATA.startswith(names.DATA_MOUNT + "/")


def test_probes_ask_the_agent_over_https(full: ClusterRef):
    c = container(full)
    expected = {"startupProbe": "/startupz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe, path in expected.items():
        get = c[probe]["httpGet"]
        assert get["path"] == path and get["scheme"] == "HTTPS", probe
        assert ports[get["port"]] == names.AGENT_PORT, probe
    startup, liveness, readiness = (c[p] for p in expected)
    # Seeding and a long WAL replay must never be cut short by liveness: an hour at least.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    # Liveness waits longer than the agent's own crash restarts back off (30 s).
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > 30
    assert readiness["periodSeconds"] <= 2


def test_the_grace_period_covers_a_switchover(full: ClusterRef):
    pod = statefulset.statefulset(full)["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    env = {e["name"]: e.get("value") for e in container(full)["env"]}
    assert env["PGHERD_GRACE_PERIOD"] == str(grace)
    options = AgentOptions(
        cluster="demo", member="demo-0", pgdata=Path(names.PGDATA), token_file=Path("t"), no_tls=True
    )
    waits = dataclasses.replace(options, grace_period=float(grace)).wait_for_switchover
    assert waits >= 60  # what a terminating primary leaves the operator for the switchover
    assert waits + 2 * options.stop_timeout < grace  # and the clean shutdown still fits


def test_the_agent_serves_metrics_and_the_custom_queries_of_a_config_map(
    full: ClusterRef, minimal: ClusterRef, monkeypatch: pytest.MonkeyPatch
):
    # every member serves GET /metrics on the container port `metrics`, which its agent is told (the
    # NetworkPolicy admits that port, and it is the agent's own default)
    assert names.METRICS_PORT == AGENT_METRICS_PORT == 9187
    for ref in (full, minimal):
        ports = {p["name"]: p["containerPort"] for p in container(ref)["ports"]}
        assert ports["metrics"] == 9187
        assert env_of(ref)["PGHERD_METRICS_PORT"] == "9187"
        assert "PGHERD_CUSTOM_QUERIES" not in env_of(ref)
        assert all(
            "custom" not in v["name"]
            for v in statefulset.statefulset(ref)["spec"]["template"]["spec"]["volumes"]
        )
    # spec.monitoring.customQueries: the ConfigMap as a whole directory (an edit reaches the pod; a
    # subPath mount would not be updated), optional (a missing one does not hold the pod back)
    ref = make_ref({**FULL_SPEC, "monitoring": {"customQueries": {"configMapName": "shop-queries"}}})
    pod = statefulset.statefulset(ref)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == "shop-queries"]
    assert volume["configMap"] == {"name": "shop-queries", "optional": True}
    (mount,) = [m for m in container(ref)["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True and "subPath" not in mount
    path = env_of(ref)["PGHERD_CUSTOM_QUERIES"]
    assert path == f"{mount['mountPath']}/queries.yaml"
    other = make_ref({**FULL_SPEC, "monitoring": {"customQueries": {"configMapName": "q", "key": "pg.yaml"}}})
    assert env_of(other)["PGHERD_CUSTOM_QUERIES"].endswith("/pg.yaml")
    for version in VERSIONS:
        kubernetes_validate.validate(statefulset.statefulset(ref), version, strict=True)
    # the agent's real parser takes both variables
    for name in list(os.environ):
        if name.startswith("PGHERD_"):
            monkeypatch.delenv(name)
    for name, value in env_of(ref).items():
        monkeypatch.setenv(name, value)
    parser, _ = run_parser()
    args = parser.parse_args(["instance", "run"])
    assert (args.metrics_port, args.custom_queries) == (9187, Path(path))
    # neither the spec revision (no restart for it) nor a bad name or key gets through
    assert ref.revision == full.revision
    for bad in ({"configMapName": "Shop_Queries"}, {"configMapName": "q", "key": "../etc/passwd"}, {}):
        with pytest.raises(ValueError):
            PostgresClusterSpec.model_validate({"monitoring": {"customQueries": bad}})


# --- the restricted Pod Security Standard ------------------------------------------------------------

RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def restricted_violations(pod: Mapping[str, Any]) -> list[str]:
    """Every check of the "restricted" Pod Security Standard (baseline included), for a pod spec."""
    found: list[str] = []
    pod_sc = pod.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            found.append(flag)
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {kinds}")
    if pod_sc.get("runAsUser") == 0:
        found.append("pod runAsUser 0")
    if pod_sc.get("sysctls"):
        found.append("sysctls")
    if (pod_sc.get("seLinuxOptions") or {}).get("user") or (pod_sc.get("seLinuxOptions") or {}).get("role"):
        found.append("seLinuxOptions")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    containers = [*(pod.get("initContainers") or []), *pod["containers"]]
    for c in containers:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            found.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation")
        if not (
            sc.get("runAsNonRoot") is True
            or (pod_sc.get("runAsNonRoot") is True and "runAsNonRoot" not in sc)
        ):
            found.append(f"{name}: runAsNonRoot")
        if sc.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or pod_seccomp
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccomp {seccomp}")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{name}: capabilities not dropped")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
        if sc.get("procMount") not in (None, "Default"):
            found.append(f"{name}: procMount")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            found.append(f"{name}: hostPort")
        if sc.get("readOnlyRootFilesystem") is not True:  # pgherd's own rule, beyond the standard
            found.append(f"{name}: writable root filesystem")
    return found


def test_pods_meet_the_restricted_pod_security_standard(full: ClusterRef, minimal: ClusterRef):
    seen = []
    for ref in (full, minimal):
        for name, pod in pod_specs(ref):
            seen.append(name)
            assert restricted_violations(pod) == [], name
            sc = pod["securityContext"]
            assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (999, 999, 999), name
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert pod["automountServiceAccountToken"] is False, name
            assert pod["serviceAccountName"] == f"{ref.name}-postgres", name
            mounts = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"]}
            assert "/tmp" in mounts, name  # the writable scratch space of a read-only root
    assert seen == ["demo", "demo-nightly-snapshot", "demo-prune-20250131t030000", "solo"]


def test_the_checker_catches_violations(full: ClusterRef):
    pod = copy.deepcopy(statefulset.statefulset(full)["spec"]["template"]["spec"])
    c = pod["containers"][0]
    c["securityContext"]["allowPrivilegeEscalation"] = True
    c["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    pod["securityContext"]["seccompProfile"] = {"type": "Unconfined"}
    del c["securityContext"]["seccompProfile"]
    assert len(restricted_violations(pod)) == 5


def test_only_the_volumes_need_writing(full: ClusterRef):
    """The agent writes its state, sockets and logs on the data volume (docs/agent.md, "On the
    volume"): with the default layout, nothing but /tmp and the data volume is writable."""
    options = AgentOptions(
        cluster="demo", member="demo-0", pgdata=Path(names.PGDATA), token_file=Path("t"), no_tls=True
    )
    for path in (options.state_file, options.passfile, options.socket_dir, options.kept, options.log_file):
        assert str(path).startswith(names.DATA_MOUNT + "/"), path
    writable = {m["mountPath"] for m in container(full)["volumeMounts"] if not m.get("readOnly")}
    assert writable == {names.DATA_MOUNT, "/tmp"}


# --- the agent's configuration -----------------------------------------------------------------------


def run_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="pgherd")
    instance_command.register(parser.add_subparsers(dest="command"))
    instance = parser._subparsers._group_actions[0].choices["instance"]  # type: ignore[union-attr]
    run = instance._subparsers._group_actions[0].choices["run"]
    return parser, run


def env_of(ref: ClusterRef, member: str = "demo-1") -> dict[str, str]:
    """The container's variables as the kubelet resolves them (Secret references left as a marker)."""
    values = {}
    for item in container(ref)["env"]:
        if "value" in item:
            values[item["name"]] = item["value"]
        elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            values[item["name"]] = member
        else:
            values[item["name"]] = "<from a Secret>"
    return values


# Variables the data plane's S3 client reads (pgherd_backup.store.S3Settings.from_env), not agent flags.
S3_VARIABLES = {"PGHERD_S3_FORCE_PATH_STYLE"}


@pytest.mark.parametrize(
    ("spec", "log_format"),
    [(FULL_SPEC, "text"), (MINIMAL_SPEC, "text"), (FULL_SPEC, "json")],
    ids=["full", "minimal", "full-json-logs"],
)
def test_every_pgherd_variable_is_read_by_the_agent(
    spec: dict[str, Any], log_format: str, monkeypatch: pytest.MonkeyPatch
):
    ref = dataclasses.replace(make_ref(spec), log_format=log_format)
    env = env_of(ref)
    _, run = run_parser()
    flags = {
        option
        for action in run._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    s3_source = inspect.getsource(S3Settings.from_env)
    for name in S3_VARIABLES:
        assert f'"{name}"' in s3_source, name
    ours = {name for name in env if name.startswith("PGHERD_")}
    for name in ours - S3_VARIABLES:
        flag = "--" + name.removeprefix("PGHERD_").lower().replace("_", "-")
        assert flag in flags, f"{name}: `pgherd instance run` has no {flag}"
    # Read for real: the parser built with these variables set holds their values.
    for name in list(os.environ):
        if name.startswith("PGHERD_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser, _ = run_parser()
    args = parser.parse_args(["instance", "run"])
    for name in ours - S3_VARIABLES:
        dest = name.removeprefix("PGHERD_").lower()
        got = getattr(args, dest)
        if isinstance(got, bool):  # a switch: set by "true"
            assert got is (env[name] == "true"), name
            continue
        assert str(got if not isinstance(got, float) else int(got)) == env[name], name
    assert args.member == "demo-1"
    assert args.pgdata == Path(names.PGDATA)
    assert args.seed == "none"
    assert args.no_tls is False
    assert args.pg_tls is True


def test_the_agents_log_as_the_operator_does(full: ClusterRef):
    """The operator's --log-format reaches the agents; text (their default) adds nothing to the template,
    so that an operator upgrade leaves the StatefulSet of every cluster logging in text as it was."""
    assert not {"PGHERD_LOG_FORMAT", "PGHERD_NAMESPACE"} & set(env_of(full))
    env = env_of(dataclasses.replace(full, log_format="json"))
    assert env["PGHERD_LOG_FORMAT"] == "json"
    assert env["PGHERD_NAMESPACE"] == NAMESPACE


def test_agent_variables(full: ClusterRef, minimal: ClusterRef):
    env = env_of(full)
    assert env["PGHERD_CLUSTER"] == "demo"
    assert env["PGHERD_REVISION"] == full.revision
    assert (env["PGHERD_PORT"], env["PGHERD_PG_PORT"]) == ("8008", "5432")
    assert env["PGHERD_APP_USER"] == "shopper" and env["PGHERD_APP_DATABASE"] == "orders"
    assert env["PGHERD_SUPERUSER"] == "postgres"
    assert env["PGHERD_REPLICATION_USER"] == "streaming_replica"
    assert env["PGHERD_TOKEN_FILE"] == f"{names.AGENT_TLS_MOUNT}/token.sha256"
    assert env["PGHERD_STORE"] == "s3://pg-backups/prod"
    assert env["AWS_ENDPOINT_URL"] == "https://minio.storage.svc:9000"
    assert env["AWS_REGION"] == "eu-west-1"
    assert env["PGHERD_S3_FORCE_PATH_STYLE"] == "true"
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container(full)["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs == {
        "AWS_ACCESS_KEY_ID": {"name": "s3-credentials", "key": "AWS_ACCESS_KEY_ID"},
        "AWS_SECRET_ACCESS_KEY": {"name": "s3-credentials", "key": "AWS_SECRET_ACCESS_KEY"},
    }
    settings = S3Settings.from_env({k: v for k, v in env.items()})
    assert settings.endpoint_url == "https://minio.storage.svc:9000" and settings.force_path_style is True
    solo = env_of(minimal)
    assert "PGHERD_STORE" not in solo and not any(k.startswith("AWS_") for k in solo)
    assert solo["PGHERD_APP_USER"] == "app" and solo["PGHERD_APP_DATABASE"] == "app"
    assert "POD_IP" not in solo  # the agent reads no such variable


def test_every_file_the_agent_is_given_is_mounted_from_a_key_that_exists(full: ClusterRef, secret_data):
    pod = statefulset.statefulset(full)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container(full)["volumeMounts"]}
    built = {s["metadata"]["name"]: s for s in secret_objects(full, secret_data)}
    built[names.configmap("demo")] = cm.configmap(full)
    file_vars = [
        name
        for name in env_of(full)
        if name.startswith("PGHERD_") and name.endswith(("_FILE", "_CERT", "_KEY", "_CA"))
    ]
    assert len(file_vars) == 14
    for name in file_vars:
        path = Path(env_of(full)[name])
        volume = volumes[mounts[str(path.parent)]]
        source = volume.get("secret") or volume["configMap"]
        source_name = source.get("secretName") or source.get("name")
        if "items" in source:
            assert path.name in {item["path"] for item in source["items"]}, name
        assert path.name in built[source_name]["data"], name


# --- Secrets -----------------------------------------------------------------------------------------

SECRET_KEYS = (
    "password",
    "uri",
    "token",
    "tls.key",
    "ca.key",
    "token.sha256",
    "replication.key",
    "postgres.key",
)


def test_no_secret_value_leaves_the_secrets(full: ClusterRef, minimal: ClusterRef, secret_data):
    values = [data[key] for data in secret_data.values() for key in SECRET_KEYS if key in data]
    assert len(values) == 10
    for ref in (full, minimal):
        text = json.dumps(non_secret_objects(ref))
        for value in values:
            assert value not in text
            assert base64.b64encode(value.encode()).decode() not in text
    for secret in secret_objects(full, secret_data):
        visible = json.dumps(secret["metadata"])
        assert not any(value in visible for value in values), secret["metadata"]["name"]


def test_secret_objects(full: ClusterRef, secret_data):
    built = {s["metadata"]["name"]: s for s in secret_objects(full, secret_data)}
    for secret in built.values():
        assert "stringData" not in secret
        name = secret["metadata"]["name"]
        kind = "kubernetes.io/tls" if name == "demo-agent" else "Opaque"
        assert secret["type"] == kind, name
    values = {name: secrets.secret_values(s) for name, s in built.items()}
    assert values["demo-superuser"] == secret_data["superuser"]
    assert values["demo-superuser"]["username"] == "postgres"
    assert values["demo-replication"]["username"] == "streaming_replica"
    assert set(values["demo-app"]) == {"username", "password", "dbname", "host", "port", "uri", "ca.crt"}
    assert values["demo-app"]["ca.crt"] == secret_data["operator"]["ca.crt"]
    assert values["demo-app"]["host"] == "demo-rw.shop.svc"
    assert values["demo-app"]["port"] == "5432"
    assert (values["demo-app"]["username"], values["demo-app"]["dbname"]) == ("shopper", "orders")
    assert set(values["demo-agent"]) == {
        "tls.crt",
        "tls.key",
        "ca.crt",
        "token.sha256",
        "replication.crt",
        "replication.key",
        "postgres.crt",
        "postgres.key",
        "postgres-ca.crt",
        "client-ca.crt",
    }
    # Without certificates of the user's, PostgreSQL's are the agent's and the cluster CA.
    agent = values["demo-agent"]
    assert (agent["postgres.crt"], agent["postgres.key"]) == (agent["tls.crt"], agent["tls.key"])
    assert agent["postgres-ca.crt"] == agent["client-ca.crt"] == agent["ca.crt"]
    assert set(values["demo-operator"]) == {"token", "ca.crt", "ca.key"}
    with pytest.raises(ValueError, match="password"):
        secrets.superuser_secret(full, {"username": "postgres"})


def test_the_uri_quotes_a_hostile_password(full: ClusterRef):
    password = "p@ss:w/o%rd?#& ='\\x"
    data = secrets.app_data(full, password, "the CA")
    uri = data["uri"]
    assert uri.startswith("postgresql://shopper:")
    assert uri.endswith("@demo-rw.shop.svc:5432/orders?sslmode=verify-full")
    parsed = conninfo_to_dict(uri)
    assert parsed["password"] == password
    assert (parsed["user"], parsed["host"], parsed["port"], parsed["dbname"], parsed["sslmode"]) == (
        "shopper",
        "demo-rw.shop.svc",
        "5432",
        "orders",
        "verify-full",
    )


def test_generated_secrets_are_fresh_and_strong():
    for generate in (secrets.generate_password, secrets.generate_token):
        first, second = generate(), generate()
        assert first != second
        alphabet = set(string.ascii_letters + string.digits + "-_")
        assert set(first) <= alphabet  # token_urlsafe: 6 bits per character
        assert len(first) * math.log2(64) >= 256
        assert len(set(first + second)) > 20  # not a constant or a short cycle
    assert secrets.generate_superuser_data() != secrets.generate_superuser_data()


def test_the_agent_credentials_work_together(full: ClusterRef, secret_data):
    """A real TLS handshake (in memory): the operator, trusting only this cluster's CA and checking
    agent_server_hostname, accepts a member's certificate; another cluster's names are refused. The
    members' token digest accepts the operator's token and nothing else."""
    agent, operator = secret_data["agent"], secret_data["operator"]
    assert agent["ca.crt"] == operator["ca.crt"]
    assert check_bearer(f"Bearer {operator['token']}", agent["token.sha256"]) is Verdict.ALLOWED
    assert check_bearer("Bearer guess", agent["token.sha256"]) is Verdict.WRONG
    assert operator["token"] not in json.dumps(agent)

    assert secrets.agent_server_hostname("demo", "demo-2", "shop") == "demo-2.demo-headless.shop.svc"
    assert secrets.agent_server_hostname("demo", "demo-2", "shop") == names.member_host(
        "demo", "demo-2", "shop"
    )
    assert handshake(agent, secrets.agent_server_hostname("demo", "demo-2", "shop"))
    assert handshake(agent, "demo-14.demo-headless.shop")  # the shorter spellings as well
    assert not handshake(agent, "demo-2.other-headless.shop.svc")
    assert not handshake(agent, "demo-2.demo-headless.elsewhere.svc")


def handshake(agent: Mapping[str, str], server_hostname: str) -> bool:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for key in ("tls.crt", "tls.key", "ca.crt"):
            (Path(folder) / key).write_text(agent[key])
        server = server_context(Path(folder) / "tls.crt", Path(folder) / "tls.key")
        client = client_context(Path(folder) / "ca.crt")
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(to_client, to_server, server_hostname=server_hostname)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side in (c, s):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLCertVerificationError:
                return False
            except ssl.SSLError:
                return False
        s_in.write(to_server.read())
        to_client.write(s_out.read())
        try:
            c.do_handshake()
            return True
        except ssl.SSLWantReadError:
            continue
        except ssl.SSLError:
            return False
    return False


# --- ConfigMap ---------------------------------------------------------------------------------------


def test_parameters_read_back_as_written(full: ClusterRef, tmp_path: Path):
    text = cm.configmap(full)["data"][names.PARAMETERS_FILE]
    path = tmp_path / "parameters.conf"
    path.write_text(text)
    timing = replication_timing(full.spec.failover.detection_seconds)
    assert read_parameters(path) == {**timing, **(full.spec.parameters or {})}
    path.write_text(cm.configmap(make_ref(MINIMAL_SPEC))["data"][names.PARAMETERS_FILE])
    # detectionSeconds 5 (the default): a silent primary is seen after 5 s + 1 s, not PostgreSQL's 60 s.
    assert read_parameters(path) == {
        "wal_receiver_timeout": "10s",
        "wal_receiver_status_interval": "1s",
        "wal_retrieve_retry_interval": "500ms",
        "wal_sender_timeout": "10s",
    }
    mine = make_ref({**MINIMAL_SPEC, "parameters": {"wal_receiver_timeout": "60s"}})
    path.write_text(cm.configmap(mine)["data"][names.PARAMETERS_FILE])
    assert read_parameters(path)["wal_receiver_timeout"] == "60s"  # the user's own value wins
    for cut in ("\n", "\v", "\x85", "\u2028", "\r"):
        with pytest.raises(ValueError, match="line separator"):
            cm.render_parameters({"application_name": f"a{cut}port = 1"})
    with pytest.raises(ValueError, match="not a PostgreSQL setting name"):
        cm.render_parameters({"bad name": "1"})
    with pytest.raises(ValueError, match="owned by the operator"):
        cm.render_parameters({"Archive_Cleanup_Command": "id"})


# --- PodDisruptionBudget -----------------------------------------------------------------------------


@pytest.mark.parametrize("instances", range(1, MAX_INSTANCES + 1))
def test_the_budget_keeps_a_majority(instances: int):
    spec = {"instances": instances, "replication": {"mode": "async"}}
    budget = pdb.pdb(make_ref(spec))
    if instances == 1:
        assert budget is None
        return
    assert budget is not None
    # The disruption controller's rounding of a percentage minAvailable (up), of the pods' controller's
    # replicas: a majority at every size.
    percent = int(budget["spec"]["minAvailable"].rstrip("%"))
    assert math.ceil(percent * instances / 100) == instances // 2 + 1
    assert budget["spec"]["selector"] == {"matchLabels": names.selector_labels("demo")}
    # The same object at every size: a scale writes no budget (one write less per change of instances).
    assert budget == pdb.pdb(make_ref({**spec, "instances": 2}))


# --- NetworkPolicy -----------------------------------------------------------------------------------


def matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics, for the checks below."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        present = key in labels
        if (
            (operator == "In" and (not present or labels[key] not in values))
            or (operator == "NotIn" and present and labels[key] in values)
            or (operator == "Exists" and not present)
            or (operator == "DoesNotExist" and present)
        ):
            return False
    return True


def ingress_by_port(policy: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    rules: dict[int, dict[str, Any]] = {}
    for rule in policy["spec"]["ingress"]:
        (port,) = rule["ports"]
        assert port["protocol"] == "TCP"
        rules[port["port"]] = rule
    return rules


def test_the_network_policy_selects_the_members_and_admits_ingress_only(minimal: ClusterRef):
    policy = networkpolicy.network_policy(minimal, OPERATOR)
    assert policy is not None
    member_labels = statefulset.statefulset(minimal)["spec"]["template"]["metadata"]["labels"]
    assert matches(policy["spec"]["podSelector"], member_labels)
    assert policy["spec"]["podSelector"] == {"matchLabels": names.selector_labels("solo")}
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # the members' own connections are not limited
    assert set(ingress_by_port(policy)) == {names.AGENT_PORT, names.POSTGRES_PORT, names.METRICS_PORT}


def test_the_metrics_port_admits_anyone(full: ClusterRef):
    """Scrapers run anywhere (a monitoring namespace, outside the cluster); `clients` narrows PostgreSQL only."""
    policy = networkpolicy.network_policy(full, OPERATOR)
    assert policy is not None
    assert ingress_by_port(policy)[names.METRICS_PORT] == {"ports": [{"protocol": "TCP", "port": 9187}]}


def test_the_agent_port_admits_the_operator_pods_alone(minimal: ClusterRef):
    policy = networkpolicy.network_policy(minimal, OPERATOR)
    assert policy is not None
    (peer,) = ingress_by_port(policy)[names.AGENT_PORT]["from"]
    assert peer == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pgherd-system"}},
        "podSelector": {"matchLabels": dict(OPERATOR.labels)},
    }
    # An operator that does not know its pods (run outside the chart) must still reach the agents.
    unknown = networkpolicy.network_policy(minimal, None)
    assert unknown is not None
    assert "from" not in ingress_by_port(unknown)[names.AGENT_PORT]


def test_postgres_admits_anyone_by_default(minimal: ClusterRef):
    policy = networkpolicy.network_policy(minimal, OPERATOR)
    assert policy is not None
    assert ingress_by_port(policy)[names.POSTGRES_PORT] == {
        "ports": [{"protocol": "TCP", "port": names.POSTGRES_PORT}]
    }


def test_postgres_admits_the_members_the_snapshot_jobs_and_the_clients_given(full: ClusterRef):
    policy = networkpolicy.network_policy(full, OPERATOR)
    assert policy is not None
    own, *clients = ingress_by_port(policy)[names.POSTGRES_PORT]["from"]
    assert clients == FULL_SPEC["networkPolicy"]["clients"]  # as written, `except` included
    assert set(own) == {"podSelector"}  # no namespaceSelector: the cluster's own namespace
    member = statefulset.statefulset(full)["spec"]["template"]["metadata"]["labels"]
    snapshot = jobs.snapshot_job(full, "nightly", "10.0.0.7")["spec"]["template"]["metadata"]["labels"]
    prune = jobs.prune_job(full, "20250131t030000", 7, None)["spec"]["template"]["metadata"]["labels"]
    assert matches(own["podSelector"], member) and matches(own["podSelector"], snapshot)
    assert not matches(own["podSelector"], prune)  # it only talks to S3
    other_cluster = statefulset.statefulset(make_ref(FULL_SPEC, name="other"))["spec"]["template"]
    assert not matches(own["podSelector"], other_cluster["metadata"]["labels"])


def test_an_empty_client_list_leaves_the_cluster_alone():
    ref = make_ref({**FULL_SPEC, "networkPolicy": {"clients": []}})
    policy = networkpolicy.network_policy(ref, OPERATOR)
    assert policy is not None
    assert ingress_by_port(policy)[names.POSTGRES_PORT]["from"] == [networkpolicy.cluster_pods_peer("demo")]


def test_no_network_policy_when_disabled():
    ref = make_ref({**MINIMAL_SPEC, "networkPolicy": {"enabled": False}})
    assert networkpolicy.network_policy(ref, OPERATOR) is None


# --- immutable fields --------------------------------------------------------------------------------


def as_stored(desired: Mapping[str, Any]) -> dict[str, Any]:
    """The StatefulSet as the API server returns it: defaults filled in, quantities canonical."""
    stored = copy.deepcopy(dict(desired))
    stored["metadata"]["uid"] = "sts-uid"
    stored["spec"]["revisionHistoryLimit"] = 10
    for claim in stored["spec"]["volumeClaimTemplates"]:
        claim["apiVersion"] = "v1"
        claim["kind"] = "PersistentVolumeClaim"
        claim["spec"]["volumeMode"] = "Filesystem"
        claim["status"] = {"phase": "Pending"}
    stored["status"] = {"replicas": 3}
    return stored


def test_immutable_field_detection(full: ClusterRef):
    desired = statefulset.statefulset(full)
    existing = as_stored(desired)
    assert statefulset.immutable_fields_changed(existing, desired) == []
    # A change of what may be patched is not an immutable change.
    changed = make_ref({**FULL_SPEC, "postgresVersion": 16, "instances": 5})
    assert statefulset.immutable_fields_changed(existing, statefulset.statefulset(changed)) == []
    # 1024Mi is 1Gi: the server's canonical spelling is not a change.
    gi = make_ref({**FULL_SPEC, "storage": {"size": "20Gi", "storageClassName": "fast-ssd"}})
    mi = statefulset.statefulset(
        make_ref({**FULL_SPEC, "storage": {"size": "20480Mi", "storageClassName": "fast-ssd"}})
    )
    assert statefulset.immutable_fields_changed(as_stored(statefulset.statefulset(gi)), mi) == []

    bigger = make_ref({**FULL_SPEC, "storage": {"size": "40Gi", "storageClassName": "fast-ssd"}})
    assert statefulset.immutable_fields_changed(existing, statefulset.statefulset(bigger)) == [
        "spec.volumeClaimTemplates"
    ]
    other_class = make_ref({**FULL_SPEC, "storage": {"size": "20Gi", "storageClassName": "slow"}})
    assert statefulset.immutable_fields_changed(existing, statefulset.statefulset(other_class)) == [
        "spec.volumeClaimTemplates"
    ]
    old = copy.deepcopy(existing)
    old["spec"]["serviceName"] = "demo"
    old["spec"]["podManagementPolicy"] = "OrderedReady"
    old["spec"]["selector"] = {"matchLabels": {names.LABEL_CLUSTER: "demo"}}
    assert statefulset.immutable_fields_changed(old, desired) == [
        "spec.selector",
        "spec.serviceName",
        "spec.podManagementPolicy",
    ]


def test_the_patch_holds_only_what_may_change(full: ClusterRef):
    desired = statefulset.statefulset(full)
    patch = statefulset.patchable(desired)
    assert set(patch) == {"metadata", "spec"}
    assert set(patch["spec"]) == {
        "replicas",
        "template",
        "updateStrategy",
        "persistentVolumeClaimRetentionPolicy",
    }
    assert not set(patch["spec"]) & set(statefulset.IMMUTABLE_SPEC_FIELDS)
    assert patch["spec"]["template"] == desired["spec"]["template"]
    assert patch["metadata"] == {"labels": desired["metadata"]["labels"]}


# --- Services ----------------------------------------------------------------------------------------


def selects(service: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    selector = service["spec"]["selector"]
    return selector is not None and selector.items() <= labels.items()


def test_service_selectors(full: ClusterRef):
    built = {s["metadata"]["name"]: s for s in services.services(full)}
    pod = statefulset.statefulset(full)["spec"]["template"]["metadata"]["labels"]
    primary = {**pod, names.LABEL_ROLE: names.ROLE_PRIMARY}
    replica = {**pod, names.LABEL_ROLE: names.ROLE_REPLICA}
    unlabelled = dict(pod)
    expect = {
        "demo-rw": (False, False, False),  # the operator's own EndpointSlice (test_rw_slice.py)
        "demo-ro": (False, True, False),
        "demo-r": (True, True, True),
        "demo-headless": (True, True, True),
    }
    for name, (p, r, u) in expect.items():
        assert (
            selects(built[name], primary),
            selects(built[name], replica),
            selects(built[name], unlabelled),
        ) == (
            p,
            r,
            u,
        ), name
    # null, not absent: a merge patch removes the selector an earlier version set.
    assert "selector" in built["demo-rw"]["spec"] and built["demo-rw"]["spec"]["selector"] is None
    assert built["demo-ro"]["spec"]["selector"][names.LABEL_ROLE] == "replica"
    # A Job's pod carries the cluster label too: no Service may route clients to it.
    for job in (jobs.snapshot_job(full, "b", "h"), jobs.prune_job(full, "s", 1, None)):
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert labels[names.LABEL_CLUSTER] == "demo"
        assert not any(selects(s, {**labels, names.LABEL_ROLE: "primary"}) for s in built.values())
    # Another cluster's members are not selected either.
    other = statefulset.statefulset(make_ref(FULL_SPEC, name="demo2"))["spec"]["template"]["metadata"][
        "labels"
    ]
    assert not any(selects(s, {**other, names.LABEL_ROLE: "primary"}) for s in built.values())


def test_service_ports(full: ClusterRef):
    built = {s["metadata"]["name"]: s for s in services.services(full)}
    for name in ("demo-rw", "demo-ro", "demo-r"):
        assert built[name]["spec"]["ports"] == [
            {"name": "postgres", "port": 5432, "targetPort": "postgres", "protocol": "TCP"}
        ]
        assert "clusterIP" not in built[name]["spec"]
    headless = built["demo-headless"]["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["publishNotReadyAddresses"] is True
    assert {p["name"]: p["port"] for p in headless["ports"]} == {"postgres": 5432, "agent": 8008}


# --- Jobs --------------------------------------------------------------------------------------------


def test_the_snapshot_job(full: ClusterRef):
    job = jobs.snapshot_job(full, "nightly", "demo-1.demo-headless.shop.svc", member="demo-1")
    assert job["metadata"]["name"] == names.snapshot_job("nightly")
    labels = job["metadata"]["labels"]
    assert labels[names.LABEL_BACKUP] == "nightly"
    assert labels[names.LABEL_MEMBER] == "demo-1"
    assert job["spec"]["template"]["metadata"]["labels"] == labels
    assert labels[names.LABEL_COMPONENT] == names.COMPONENT_SNAPSHOT
    spec = job["spec"]
    assert spec["backoffLimit"] == 2
    assert spec["activeDeadlineSeconds"] == 6 * 3600
    assert "ttlSecondsAfterFinished" not in spec  # the operator reads the result first
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["image"] == full.image
    assert c["terminationMessagePath"] == "/dev/termination-log"
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    env = {e["name"]: e for e in c["env"]}
    assert "PGPASSWORD" not in env  # the replication certificate, no password
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-credentials"

    args = backup_cli.build_parser().parse_args(c["command"][1:])
    assert c["command"][0] == "pgherd-backup"
    assert args.func is backup_cli.cmd_snapshot
    assert (args.store, args.cluster, args.compression) == ("s3://pg-backups/prod", "demo", "lz4")
    assert args.result_file == "/dev/termination-log"
    assert args.verify, "the Backup's `verified` comes from the Job reading its snapshot back"
    source = conninfo_to_dict(args.source)
    assert source == {
        "host": "demo-1.demo-headless.shop.svc",
        "port": "5432",
        "user": "streaming_replica",
        "dbname": "postgres",
        "application_name": "pgherd-snapshot",
        "connect_timeout": "10",
        "sslmode": "verify-ca",
        "sslrootcert": "/etc/pgherd/replication/ca.crt",
        "sslcert": "/etc/pgherd/replication/replication.crt",
        "sslkey": "/etc/pgherd/replication/replication.key",
    }
    odd = conninfo_to_dict(jobs.source_dsn("odd host'\\", 5433))
    assert (odd["host"], odd["port"]) == ("odd host'\\", "5433")


def test_the_prune_job(full: ClusterRef):
    job = jobs.prune_job(full, "20250131t030000", 7, "14d")
    assert job["metadata"]["name"] == "demo-prune-20250131t030000"
    assert job["metadata"]["labels"][names.LABEL_COMPONENT] == names.COMPONENT_PRUNE
    assert job["spec"]["backoffLimit"] == 2 and job["spec"]["activeDeadlineSeconds"] > 0
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert not any(e["name"] == "PGPASSWORD" for e in c["env"])  # it never touches PostgreSQL
    args = backup_cli.build_parser().parse_args(c["command"][1:])
    assert args.func is backup_cli.cmd_prune
    assert (args.store, args.cluster, args.keep_last, args.keep_within) == (
        "s3://pg-backups/prod",
        "demo",
        7,
        "14d",
    )
    assert args.result_file == "/dev/termination-log"
    only_last = backup_cli.build_parser().parse_args(jobs.prune_command(full, 3, None)[1:])
    assert (only_last.keep_last, only_last.keep_within) == (3, None)
    with pytest.raises(ValueError):
        jobs.prune_command(full, None, None)
    with pytest.raises(ValueError, match=r"no backup\.store"):
        jobs.prune_job(make_ref(MINIMAL_SPEC), "s", 1, None)


def test_the_result_is_read_from_the_termination_message():
    summary = {"id": "20250131T030000Z", "start_lsn": "0/3000028", "stop_lsn": "0/3000100", "size": 1}

    def pod(message: str | None) -> dict[str, Any]:
        terminated = {"exitCode": 0, **({"message": message} if message is not None else {})}
        return {"status": {"containerStatuses": [{"name": "snapshot", "state": {"terminated": terminated}}]}}

    assert jobs.job_result(pod(backup_cli.result_document(summary))) == summary
    assert jobs.job_result(pod(None)) is None
    assert jobs.job_result({"status": {}}) is None
    failed = pod("progress 10%\npgherd-backup: error: cannot connect to the source server\n")
    assert jobs.job_result(failed) is None
    assert jobs.job_error(failed) == "pgherd-backup: error: cannot connect to the source server"


# --- images ------------------------------------------------------------------------------------------


def test_resolve_image():
    spec = PostgresClusterSpec.model_validate({"postgresVersion": 15})
    assert resolve_image(spec, "registry/pgherd:1.0-pg{major}", "d") == "registry/pgherd:1.0-pg15"
    assert resolve_image(spec, "", "registry/pgherd:1.0") == "registry/pgherd:1.0"
    pinned = PostgresClusterSpec.model_validate({"postgresVersion": 15, "image": "mine:16"})
    assert resolve_image(pinned, "registry/pgherd:1.0-pg{major}", "d") == "mine:16"


def test_agent_secrets_for_a_long_cluster_and_namespace_name() -> None:
    """A member's DNS name in a long namespace exceeds X.509's 64-character common name: the certificate
    is still made (the names are in its subject alternative names, which clients check). The operator
    crashed on it in a loop (ValueError from cryptography) for cluster e2e-autorecover-faults."""
    from cryptography import x509

    from pgherd.kube.builders import secrets as secret_builders

    cluster, namespace = "e2e-autorecover-faults", "pgherd-e2e-e2e-autorecover-faults"
    data = secret_builders.generate_agent_data(
        cluster, namespace, secret_builders.generate_operator_data(cluster)
    )
    cert = x509.load_pem_x509_certificate(data[secret_builders.names.KEY_TLS_CERT].encode())
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = set(alt.get_values_for_type(x509.DNSName))
    wanted = set(secret_builders.agent_server_names(cluster, namespace))
    assert wanted <= dns and any(len(name) > 64 for name in wanted)


# --- PostgreSQL's TLS --------------------------------------------------------------------------------


def test_the_members_certificate_names_every_way_a_client_reaches_them(full: ClusterRef, secret_data):
    """verify-full through each Service (its four spellings), by a member's headless name or its pod
    name (ordinals 0 to 14, instances' maximum): a real handshake each; another cluster's names fail."""
    from cryptography import x509

    agent = secret_data["agent"]
    cert = x509.load_pem_x509_certificate(agent["tls.crt"].encode())
    dns = set(
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName
        )
    )
    for service in ("demo-rw", "demo-ro", "demo-r"):
        assert {service, f"{service}.shop", f"{service}.shop.svc", f"{service}.shop.svc.cluster.local"} <= dns
    assert {f"demo-{i}" for i in range(15)} <= dns and "demo-15" not in dns
    assert {"*.demo-headless.shop.svc", "*.demo-headless.shop", "*.demo-headless"} <= dns
    for name in (
        "demo-rw.shop.svc",
        "demo-ro",
        "demo-r.shop.svc.cluster.local",
        "demo-14",
        "demo-0.demo-headless.shop.svc",
    ):
        assert handshake(agent, name), name
    for name in ("other-rw.shop.svc", "demo-rw.elsewhere.svc", "demo-15"):
        assert not handshake(agent, name), name


def test_the_replication_certificate_is_the_replication_accounts(secret_data):
    """CN streaming_replica (what pg_hba's `cert` matches), for client authentication, signed by the
    cluster's CA, with the key beside it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    agent, operator = secret_data["agent"], secret_data["operator"]
    cert = x509.load_pem_x509_certificate(agent["replication.crt"].encode())
    ca = x509.load_pem_x509_certificate(operator["ca.crt"].encode())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == names.REPLICATION_USER
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    cert.verify_directly_issued_by(ca)
    key = serialization.load_pem_private_key(agent["replication.key"].encode(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert lifetime == timedelta(days=90, minutes=5)  # spec.tls.certificateLifetime's default


def test_the_members_run_postgres_with_tls(full: ClusterRef):
    env = env_of(full)
    assert env["PGHERD_PG_TLS"] == "true"
    assert env["PGHERD_REPLICATION_CERT"] == f"{names.AGENT_TLS_MOUNT}/replication.crt"
    assert env["PGHERD_REPLICATION_KEY"] == f"{names.AGENT_TLS_MOUNT}/replication.key"
    assert env["PGHERD_PG_TLS_MIN_VERSION"] == "TLSv1.3"
    assert "PGHERD_SUPERUSER_NETWORK_ACCESS" not in env  # the superuser on the Unix socket only
    asked = make_ref({**FULL_SPEC, "tls": {"minProtocolVersion": "TLSv1.2"}, "superuserNetworkAccess": True})
    env = env_of(asked)
    assert env["PGHERD_PG_TLS_MIN_VERSION"] == "TLSv1.2"
    assert env["PGHERD_SUPERUSER_NETWORK_ACCESS"] == "true"
    assert asked.revision != full.revision  # flags read at start: a rolling restart
    pod = statefulset.statefulset(full)["spec"]["template"]["spec"]
    (agent,) = [v for v in pod["volumes"] if v["name"] == statefulset.VOLUME_AGENT]
    assert [i["key"] for i in agent["secret"]["items"]] == [
        "tls.crt",
        "tls.key",
        "ca.crt",
        "token.sha256",
        "replication.crt",
        "replication.key",
        "postgres.crt",
        "postgres.key",
        "postgres-ca.crt",
        "client-ca.crt",
    ]
    # PostgreSQL's own files (the user's certificates when spec.tls names them): no restart to switch.
    assert env["PGHERD_PG_TLS_CERT"] == f"{names.AGENT_TLS_MOUNT}/postgres.crt"
    assert env["PGHERD_PG_TLS_KEY"] == f"{names.AGENT_TLS_MOUNT}/postgres.key"
    assert env["PGHERD_PG_TLS_CA"] == f"{names.AGENT_TLS_MOUNT}/postgres-ca.crt"
    assert env["PGHERD_PG_CLIENT_CA"] == f"{names.AGENT_TLS_MOUNT}/client-ca.crt"
    named = make_ref({**FULL_SPEC, "tls": {"serverCertSecret": "pg-tls", "clientCASecret": "pg-client-ca"}})
    assert named.revision == full.revision
    assert statefulset.statefulset(named) == statefulset.statefulset(full)


def test_the_snapshot_job_reads_by_the_replication_certificate_alone(full: ClusterRef, secret_data):
    """Only the CA of the members' PostgreSQL certificate and the replication certificate and key of the
    agents' Secret reach the Job: never a server key nor the token's digest; the DSN's files are where
    they are mounted."""
    job = jobs.snapshot_job(full, "nightly", "demo-1.demo-headless.shop.svc", member="demo-1")
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    secret_volumes = [v for v in pod["volumes"] if "secret" in v]
    assert secret_volumes == [
        {
            "name": "replication-tls",
            "secret": {
                "secretName": "demo-agent",
                "defaultMode": 0o440,
                "items": [
                    {"key": "postgres-ca.crt", "path": "ca.crt"},
                    {"key": "replication.crt", "path": "replication.crt"},
                    {"key": "replication.key", "path": "replication.key"},
                ],
            },
        }
    ]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "replication-tls")
    assert mount == {"name": "replication-tls", "mountPath": "/etc/pgherd/replication", "readOnly": True}
    source = conninfo_to_dict(backup_cli.build_parser().parse_args(c["command"][1:]).source)
    for key in ("sslrootcert", "sslcert", "sslkey"):
        path = Path(source[key])
        assert str(path.parent) == mount["mountPath"], key
        items = secret_volumes[0]["secret"]["items"]
        assert path.name in {i["path"] for i in items}, key
        assert all(i["key"] in secret_data["agent"] for i in items)
    assert "PGPASSWORD" not in {e["name"] for e in c["env"]}
    text = json.dumps(job)
    assert "tls.key" not in text and "postgres.key" not in text and "token.sha256" not in text
    assert pod["securityContext"]["fsGroup"] == 999  # the files: root:999 0440, which libpq accepts


def test_the_app_secret_verifies_the_server_and_an_old_one_is_upgraded(full: ClusterRef, secret_data):
    data = secret_data["app"]
    assert data["ca.crt"] == secret_data["operator"]["ca.crt"]
    assert conninfo_to_dict(data["uri"])["sslmode"] == "verify-full"
    assert conninfo_to_dict(data["uri"])["host"] == "demo-rw.shop.svc"  # a name the certificate holds
    assert secrets.app_data_upgraded(full, data, data["ca.crt"]) is None
    # A cluster made before TLS: no ca.crt, a URI without sslmode; the password stays.
    old = {k: v for k, v in data.items() if k != "ca.crt"}
    old["uri"] = old["uri"].removesuffix("?sslmode=verify-full")
    upgraded = secrets.app_data_upgraded(full, old, data["ca.crt"])
    assert upgraded == data
    assert upgraded is not None and upgraded["password"] == old["password"]


def test_an_owned_object_built_again_alike_has_the_same_digest(full: ClusterRef) -> None:
    """The digest decides whether an owned object is written again: equal values give equal digests
    whatever objects hold them (a string shared or built twice), and any changed value another."""
    from pgherd.kube.objects import _digest

    assert _digest(statefulset.statefulset(full, replicas=0)) == _digest(
        statefulset.statefulset(full, replicas=0)
    )
    shared = "x" * 40
    assert _digest({"a": shared, "b": shared}) == _digest({"a": shared, "b": "".join(["x" * 20] * 2)})
    body = statefulset.statefulset(full, replicas=0)
    changed = copy.deepcopy(body)
    changed["spec"]["template"]["spec"]["containers"][0]["image"] += "-other"
    assert _digest(changed) != _digest(body)
    assert _digest({"a": 1}) != _digest({"a": "1"})
    assert _digest({"a": 1}) != _digest({"a": True})
    assert _digest({"a": 1}) != _digest({"a": 1.0})
    # A StrEnum member (a model's field dumped as is) is no marshal type: hashed from JSON instead.
    assert _digest({"policy": VolumeDeletePolicy.DELETE}) == _digest({"policy": VolumeDeletePolicy.DELETE})
    assert _digest({"policy": VolumeDeletePolicy.DELETE}) != _digest({"policy": VolumeDeletePolicy.RETAIN})
