"""A member archiving to S3 over HTTPS with a private CA (spec.backup.store.s3.endpointCA), as on
Kubernetes: the CA's file comes from an optional Secret volume, absent while the Secret is missing.

The archiver's failure says why in the agent's /status (`archive_error`, which the operator puts in the
ContinuousArchiving condition): the missing CA file by its path, then, with a CA that does not sign the
endpoint's certificate, the endpoint and that the CA does not verify it. Once the right CA is there (the
Secret created: the kubelet fills the volume), archiving resumes by itself and the error is gone.
"""

from __future__ import annotations

import shutil

from agent_helpers import CLUSTER, MEMBERS

from pgherd.local.s3server import S3Tls


def _switch_wal(primary) -> None:
    primary.sql("CREATE TABLE IF NOT EXISTS t (x int)")
    primary.sql("INSERT INTO t VALUES (1)")
    primary.value("SELECT pg_switch_wal()")


def test_the_archiver_says_why_the_store_is_refused_and_resumes_with_the_ca(agents, tls_s3_store, tmp_path):
    mounted = agents.root / "s3-ca"  # the Secret volume, empty while the Secret is missing
    mounted.mkdir(mode=0o755)
    bundle = mounted / "ca.crt"
    env = {**tls_s3_store.endpoint.env(), "AWS_CA_BUNDLE": str(bundle)}
    primary = agents.primary(MEMBERS[0], "--store", tls_s3_store.url, env=env)
    assert primary.status().archive_error is None

    _switch_wal(primary)
    primary.wait_until(lambda: primary.status().archiving_healthy is False, "the archiver's failure")
    primary.wait_until(lambda: primary.status().archive_error is not None, "the archiver's reason")
    error = primary.status().archive_error
    assert error is not None
    assert f"the CA bundle {bundle}" in error and "does not exist" in error and "endpointCA" in error

    other = S3Tls.issue(tmp_path / "other")  # a CA that did not sign the endpoint's certificate
    shutil.copy(other.ca, bundle)
    _switch_wal(primary)
    endpoint = tls_s3_store.endpoint.endpoint_url

    def untrusted() -> bool:
        error = primary.status().archive_error
        return error is not None and endpoint in error and "does not verify" in error

    primary.wait_until(untrusted, "the archiver's reason: the CA does not verify the endpoint")

    shutil.copy(str(tls_s3_store.endpoint.ca_bundle), bundle)
    _switch_wal(primary)
    primary.wait_until(lambda: primary.status().archiving_healthy is True, "archiving resumed", timeout=90)
    assert primary.status().archive_error is None
    prefix = tls_s3_store.url.split("/", 3)[3] + f"/{CLUSTER}/"
    listed = tls_s3_store.endpoint.client().list_objects_v2(
        Bucket=tls_s3_store.endpoint.bucket, Prefix=prefix
    )
    assert any("/wal/" in item["Key"] for item in listed.get("Contents", []))
