"""The settings no user may set, and the files that carry settings, read back as PostgreSQL reads them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pgherd_backup.agent.options import read_parameters
from pgherd_backup.errors import UsageError
from pgherd_backup.postgres import config, parameters


def test_every_setting_pgherd_writes_is_refused_as_a_user_parameter(tmp_path: Path) -> None:
    written = set(config.member_settings(5432, archive_command="x")) | {"cluster_name"}
    config.write_pgherd_conf(tmp_path, {})
    config.write_standby_config(tmp_path, "host=x", slot="s", restore_command="r")
    config.write_recovery_config(tmp_path, restore_command="r", target={"recovery_target_lsn": "0/1"})
    written |= set(config.read_pgherd_conf(tmp_path))
    assert written and all(parameters.is_refused(name) for name in written), sorted(
        n for n in written if not parameters.is_refused(n)
    )
    assert all(parameters.is_refused(name.upper()) for name in written)


def test_the_agent_refuses_what_the_api_refuses_whoever_wrote_the_file(tmp_path: Path) -> None:
    path = tmp_path / "parameters.conf"
    for line, words in [
        ("Port = '5433'", "owned by the operator"),
        ("archive_cleanup_command = 'id'", "owned by the operator"),
        ("ssl_min_protocol_version = 'TLSv1'", "owned by the operator"),
        ("include_dir = '/tmp'", "owned by the operator"),
        ("shared_preload_libraries = '/tmp/x.so'", "library names only"),
        ("work_mem = '4MB\x85port = 1'", "line separator"),
        ("work_mem = '4MB\u2028x'", "line separator"),
        ("work_mem = '4MB\vx'", "line separator"),
    ]:
        path.write_text(f"{parameters.HEADER}{line}\n")
        with pytest.raises(UsageError, match=words):
            read_parameters(path)
    path.write_text("shared_preload_libraries = 'pg_stat_statements'\r\nwork_mem = 64MB # a comment\n")
    assert read_parameters(path) == {"shared_preload_libraries": "pg_stat_statements", "work_mem": "64MB"}


def test_user_parameters_never_override_what_pgherd_owns() -> None:
    settings = config.member_settings(5432, extra={"port": 1, "work_mem": "1MB"})
    assert settings["port"] == 5432 and settings["work_mem"] == "1MB"


def test_a_value_with_backslashes_and_quotes_reaches_postgresql_as_written(
    pg_factory: Callable[..., Any],
) -> None:
    value = "a'b\\n\\\\c\\"
    primary = pg_factory("primary").initdb()
    config.update_pgherd_conf(primary.pgdata, {"application_name": value})
    assert config.read_pgherd_conf(primary.pgdata)["application_name"] == value
    primary.start()
    assert primary.value("SHOW application_name") == value
