"""spec.backup.store.s3.endpointCA in the manifests: every pod that talks to S3 (the members, which
archive and fetch WAL and restore; the snapshot and prune Jobs) mounts the CA's Secret read-only and is
told its path, never its content, in the variable the data plane's S3 clients read (AWS_CA_BUNDLE).

The mount is optional: a Secret or key that is missing leaves the file absent, the members start, and
the data plane names the missing CA where archiving and backups report their failures (tested in
tests/backup/test_s3_tls.py), rather than the pods waiting in ContainerCreating.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest

from pgherd.kube.builders import jobs, statefulset
from pgherd.kube.builders.common import S3_CA_FILE, S3_CA_MOUNT, VOLUME_S3_CA, ClusterRef
from pgherd_backup.store import S3Settings

from .test_builders import FULL_SPEC, VERSIONS, make_ref

CA_BUNDLE = f"{S3_CA_MOUNT}/{S3_CA_FILE}"
# MinIO's own name for its certificate file, as a key of the user's Secret.
CA_SPEC = copy.deepcopy(FULL_SPEC)
CA_SPEC["backup"]["store"]["s3"]["endpointCA"] = {"secretName": "minio-ca", "key": "public.crt"}


def s3_objects(ref: ClusterRef) -> list[dict[str, Any]]:
    return [
        statefulset.statefulset(ref),
        jobs.snapshot_job(ref, "nightly", "10.1.2.3"),
        jobs.prune_job(ref, "20250131t030000", 7, None),
    ]


def s3_pods(ref: ClusterRef) -> Iterator[tuple[str, dict[str, Any]]]:
    """(kind, pod spec) of every pod that talks to S3."""
    for obj in s3_objects(ref):
        yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]


def plain_env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container["env"] if "value" in item}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_objects_with_an_endpoint_ca_validate_strictly(version: str):
    for obj in s3_objects(make_ref(CA_SPEC)):
        kubernetes_validate.validate(obj, version, strict=True)


def test_every_s3_pod_mounts_the_ca_read_only_and_is_told_its_path():
    ref = make_ref(CA_SPEC)
    for kind, pod in s3_pods(ref):
        [volume] = [v for v in pod["volumes"] if v["name"] == VOLUME_S3_CA]
        assert volume["secret"]["secretName"] == "minio-ca", kind
        assert volume["secret"]["items"] == [{"key": "public.crt", "path": S3_CA_FILE}], kind
        assert volume["secret"]["optional"] is True, kind
        [container] = pod["containers"]
        [mount] = [m for m in container["volumeMounts"] if m["name"] == VOLUME_S3_CA]
        assert mount == {"name": VOLUME_S3_CA, "mountPath": S3_CA_MOUNT, "readOnly": True}, kind
        env = plain_env(container)
        assert env["AWS_CA_BUNDLE"] == CA_BUNDLE, kind
        settings = S3Settings.from_env(env)
        assert settings.ca_bundle == CA_BUNDLE and settings.endpoint_url == "https://minio.storage.svc:9000"
        # the path travels, never a certificate: nor on the command line
        assert "BEGIN CERTIFICATE" not in json.dumps(pod)
        assert CA_BUNDLE not in " ".join(container.get("command") or [])


def test_the_default_key_is_ca_crt():
    spec = copy.deepcopy(CA_SPEC)
    spec["backup"]["store"]["s3"]["endpointCA"] = {"secretName": "minio-ca"}
    for kind, pod in s3_pods(make_ref(spec)):
        [volume] = [v for v in pod["volumes"] if v["name"] == VOLUME_S3_CA]
        assert volume["secret"]["items"] == [{"key": "ca.crt", "path": S3_CA_FILE}], kind


def test_without_an_endpoint_ca_the_system_cas_verify():
    for kind, pod in s3_pods(make_ref(FULL_SPEC)):
        assert VOLUME_S3_CA not in {v["name"] for v in pod["volumes"]}, kind
        [container] = pod["containers"]
        assert "AWS_CA_BUNDLE" not in plain_env(container), kind
        assert S3_CA_MOUNT not in {m["mountPath"] for m in container["volumeMounts"]}, kind
