"""The operator parses specs through the same models the CRDs come from."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pgherd.api import (
    Backup,
    OnQuorumLoss,
    PostgresCluster,
    PostgresClusterSpec,
    ReplicationMode,
    Restore,
)
from pgherd.api.admission import admit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODELS = {"PostgresCluster": PostgresCluster, "Backup": Backup, "Restore": Restore}


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_parse_through_the_models(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    model = MODELS[doc["kind"]].model_validate(admit(doc))
    # Round trip: what the model writes back is admitted too and means the same.
    again = MODELS[doc["kind"]].model_validate(admit(model.to_wire()))
    assert again == model


def test_quorum_is_the_default_from_three_instances() -> None:
    assert PostgresClusterSpec(instances=3).replication_mode is ReplicationMode.QUORUM
    assert PostgresClusterSpec(instances=5).replication_mode is ReplicationMode.QUORUM
    assert PostgresClusterSpec(instances=2).replication_mode is ReplicationMode.ASYNC
    assert PostgresClusterSpec(instances=1).replication_mode is ReplicationMode.ASYNC
    explicit = PostgresClusterSpec.model_validate({"instances": 5, "replication": {"mode": "async"}})
    assert explicit.replication_mode is ReplicationMode.ASYNC


def test_archiving_defaults_on_with_a_store() -> None:
    spec = PostgresClusterSpec.model_validate(
        {"backup": {"store": {"s3": {"bucket": "bkt", "credentials": {"secretName": "s"}}}}}
    )
    assert spec.backup is not None and spec.backup.archiving_enabled
    assert not PostgresClusterSpec().backup
    assert PostgresClusterSpec().recovery.on_quorum_loss is OnQuorumLoss.WAIT


def test_model_refuses_owned_parameters_even_without_admission() -> None:
    with pytest.raises(ValidationError, match="Port: settings owned by the operator"):
        PostgresClusterSpec.model_validate({"parameters": {"Port": "5433"}})
    for name, value in {
        "archive_cleanup_command": "id",
        "SSL_key_file": "/x",
        "include_if_exists": "/x",
        "shared_preload_libraries": "pg_stat_statements,/tmp/x.so",
        "work_mem": "4MB\u2028port = 1",
        "bad name": "1",
    }.items():
        with pytest.raises(ValidationError, match="parameters"):
            PostgresClusterSpec.model_validate({"parameters": {name: value}})


def test_lsn_fields_keep_their_contract_names() -> None:
    from pgherd.api.backup import BackupStatus
    from pgherd.api.cluster import Member

    wire = BackupStatus(start_lsn="0/2000028", end_lsn="0/2000100").to_wire()
    assert wire["startLSN"] == "0/2000028" and wire["endLSN"] == "0/2000100"
    member = Member(name="m-0", received_lsn="0/5", replayed_lsn="0/4").to_wire()
    assert member["receivedLSN"] == "0/5" and member["replayedLSN"] == "0/4"
