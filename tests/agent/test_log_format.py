"""`pgherd instance run --log-format json`: every line the agent writes, from its start to its exit, is one
JSON object naming its namespace, cluster and member, and no secret is in any of them."""

from __future__ import annotations

import json
from typing import Any

from agent_helpers import CLUSTER, Agent

from conftest import Agents

KEYS = {"time", "level", "logger", "namespace", "cluster", "member", "message"}


def json_lines(agent: Agent) -> list[dict[str, Any]]:
    docs = []
    for line in agent.log.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n{agent.log[-3000:]}") from None
        assert isinstance(doc, dict) and set(doc) >= KEYS, line
        docs.append(doc)
    return docs


def test_the_agent_logs_json_lines_naming_its_member(agents: Agents) -> None:
    agent = agents.primary("agents-0", "--log-format", "json", "--namespace", "prod")
    agent.client.fence(reason="a test of the JSON log")
    agent.client.unfence(primary=True, reason="back")
    agent.stop()
    docs = json_lines(agent)
    messages = [d["message"] for d in docs]
    assert any("serving HTTPS" in m for m in messages), messages
    assert any(m.startswith("SIGTERM") for m in messages), messages
    assert {(d["namespace"], d["cluster"], d["member"]) for d in docs} == {("prod", CLUSTER, "agents-0")}
    assert {d["level"] for d in docs} <= {"debug", "info", "warning", "error", "critical"}
    assert all(d["time"].endswith("Z") and len(d["time"]) == len("2026-01-01T00:00:00.000Z") for d in docs)
    for secret in agent.certs.secrets:
        assert secret not in agent.log


def test_an_unknown_log_format_is_refused(agents: Agents) -> None:
    agent = agents("agents-1", "--log-format", "yaml", start=False)
    agent.start(wait=False)
    assert agent.wait_exit(60) == 2
    assert "invalid choice: 'yaml'" in agent.log
