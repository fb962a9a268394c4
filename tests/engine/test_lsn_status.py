"""LSN conversions and the round trip of the engine's recorded status."""

from __future__ import annotations

from datetime import timedelta

import pytest

from pgherd.engine import EngineStatus, Operation, OperationKind
from pgherd.engine.lsn import format_lsn, parse_lsn
from pgherd.engine.quorum import SyncConfig
from pgherd.engine.revision import spec_revision

from .builders import NOW, make_spec


def test_lsn_round_trip() -> None:
    assert parse_lsn("16/B374D848") == 0x16B374D848
    assert format_lsn(0x16B374D848) == "16/B374D848"
    assert format_lsn(parse_lsn("0/3000060")) == "0/3000060"


@pytest.mark.parametrize("text", ["", "16", "x/1", "1/2/3", "123456789/0"])
def test_bad_lsn(text: str) -> None:
    with pytest.raises(ValueError, match="LSN"):
        parse_lsn(text)


def test_status_round_trip() -> None:
    status = EngineStatus(
        initialized=True,
        complete=True,
        current_primary="pg-1",
        timeline=3,
        voters=frozenset({"pg-0", "pg-1", "pg-2"}),
        sync=SyncConfig(1, frozenset({"pg-0", "pg-2"})),
        sync_pending=SyncConfig(2, frozenset({"pg-0", "pg-2", "pg-3"})),
        primary_lost_since=NOW,
        last_scheduled_backup=NOW - timedelta(days=1),
        operation=Operation(
            OperationKind.ROLLOUT,
            NOW,
            step="restart:pg-2",
            step_started_at=NOW,
            plan=("pg-2", "pg-1"),
            done=(),
        ),
        aborted=Operation(OperationKind.SWITCHOVER, NOW, failed="why", final_lsn=42),
    )
    wire = status.to_dict()
    assert wire["operation"]["plan"] == ["pg-2", "pg-1"]
    assert EngineStatus.from_dict(wire) == status
    assert EngineStatus.from_dict({}) == EngineStatus()


def test_revision_changes_only_for_restart_settings() -> None:
    base = spec_revision(make_spec())
    assert spec_revision(make_spec(parameters={"work_mem": "64MB"})) == base  # reloadable
    assert spec_revision(make_spec(parameters={"shared_buffers": "1GB"})) != base
    assert spec_revision(make_spec(image="img:2")) != base
    assert spec_revision(make_spec(resources={"limits": {"memory": "2Gi"}})) != base
