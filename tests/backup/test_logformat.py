"""`--log-format` (pgherd_backup.logformat): the JSON line's keys, its time, an exception, and where the
namespace, cluster and member come from (the record, kopf's object, the context, the process)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from pgherd_backup import logformat
from pgherd_backup.logformat import JsonFormatter, LogContext, log_context
from pgherd_backup.timestamps import rfc3339

KEYS = {"time", "level", "logger", "namespace", "cluster", "member", "message"}
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture
def captured() -> Iterator[tuple[io.StringIO, logging.Logger]]:
    """A logger of its own writing JSON lines into a buffer (the root logger is left alone)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(LogContext(namespace="ns-default", member="pg-9")))
    logger = logging.getLogger(f"pgherd.test.logformat.{id(stream)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    yield stream, logger
    logger.handlers.clear()


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    text = stream.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_rfc3339_in_utc_with_the_digits_asked_for() -> None:
    moment = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=timezone(timedelta(hours=2)))
    assert rfc3339(moment) == "2026-01-02T01:04:05Z"
    assert rfc3339(moment, 3) == "2026-01-02T01:04:05.123Z"
    assert rfc3339(moment, 6) == "2026-01-02T01:04:05.123456Z"
    assert rfc3339(moment.replace(microsecond=0), 3) == "2026-01-02T01:04:05.000Z"
    with pytest.raises(ValueError):
        rfc3339(moment, 7)


def test_a_line_has_every_key_and_a_millisecond_utc_time(
    captured: tuple[io.StringIO, logging.Logger],
) -> None:
    stream, logger = captured
    before = datetime.now(UTC).replace(microsecond=0)
    logger.warning("fencing %s:\n%s", "pg-0", "second line")
    (doc,) = lines(stream)
    assert set(doc) >= KEYS, doc
    assert "exception" not in doc
    assert TIME.match(doc["time"]), doc["time"]
    at = datetime.fromisoformat(doc["time"].replace("Z", "+00:00"))
    assert before <= at <= datetime.now(UTC)
    assert doc["level"] == "warning"
    assert doc["logger"] == logger.name
    assert doc["message"] == "fencing pg-0:\nsecond line"  # on one line: the newline is escaped
    assert (doc["namespace"], doc["cluster"], doc["member"]) == ("ns-default", None, "pg-9")


def test_an_exception_is_its_own_key(captured: tuple[io.StringIO, logging.Logger]) -> None:
    stream, logger = captured
    try:
        raise RuntimeError("the agent did not answer")
    except RuntimeError:
        logger.exception("tick failed")
    (doc,) = lines(stream)
    assert doc["level"] == "error" and doc["message"] == "tick failed"
    assert doc["exception"].startswith("Traceback (most recent call last):")
    assert doc["exception"].rstrip().endswith("RuntimeError: the agent did not answer")


def test_the_context_names_the_cluster_and_inner_blocks_add_to_it(
    captured: tuple[io.StringIO, logging.Logger],
) -> None:
    stream, logger = captured
    with log_context(namespace="prod", cluster="hippo"):
        logger.info("tick")
        with log_context(member="hippo-1"):
            logger.info("fence")
        logger.info("after")
    logger.info("outside")
    docs = lines(stream)
    seen = [(d["message"], d["namespace"], d["cluster"], d["member"]) for d in docs]
    assert seen == [
        ("tick", "prod", "hippo", "pg-9"),  # the process's own member, as none is given
        ("fence", "prod", "hippo", "hippo-1"),
        ("after", "prod", "hippo", "pg-9"),
        ("outside", "ns-default", None, "pg-9"),
    ]


def test_the_record_own_names_win_then_kopf_object_then_the_context(
    captured: tuple[io.StringIO, logging.Logger],
) -> None:
    stream, logger = captured
    with log_context(namespace="prod", cluster="hippo"):
        logger.info("own", extra={"member": "hippo-2"})
        ref = {
            "apiVersion": "pgherd.io/v1alpha1",
            "kind": "PostgresCluster",
            "name": "other",
            "namespace": "qa",
        }
        logger.info("kopf's", extra={"k8s_ref": ref, "k8s_skip": False, "settings": object()})
        pod = {"apiVersion": "v1", "kind": "Pod", "name": "other-0", "namespace": "qa"}
        logger.info("a pod", extra={"k8s_ref": pod})
    docs = lines(stream)
    assert (docs[0]["namespace"], docs[0]["cluster"], docs[0]["member"]) == ("prod", "hippo", "hippo-2")
    assert (docs[1]["namespace"], docs[1]["cluster"]) == ("qa", "other")
    assert "settings" not in docs[1] and "k8s_ref" not in docs[1]
    # A pod's record names its namespace; which cluster it belongs to, kopf does not say.
    assert (docs[2]["namespace"], docs[2]["cluster"]) == ("qa", "hippo")


def test_tasks_and_threads_started_in_the_context_keep_it(
    captured: tuple[io.StringIO, logging.Logger],
) -> None:
    stream, logger = captured

    async def loop(cluster: str) -> None:
        with log_context(namespace="prod", cluster=cluster):
            await asyncio.sleep(0)
            await asyncio.to_thread(logger.info, "from a thread of %s", cluster)
            await asyncio.get_running_loop().create_task(_log_later(logger, cluster))

    async def both() -> None:
        await asyncio.gather(loop("a"), loop("b"))

    asyncio.run(both())
    docs = lines(stream)
    assert sorted((d["cluster"], d["message"]) for d in docs) == [
        ("a", "from a task of a"),
        ("a", "from a thread of a"),
        ("b", "from a task of b"),
        ("b", "from a thread of b"),
    ]
    # A plain thread started elsewhere does not inherit it.
    thread = threading.Thread(target=logger.info, args=("plain thread",))
    thread.start()
    thread.join()
    assert lines(stream)[-1]["cluster"] is None


async def _log_later(logger: logging.Logger, cluster: str) -> None:
    await asyncio.sleep(0)
    logger.info("from a task of %s", cluster)


def test_configure_sets_the_root_handler_in_either_format() -> None:
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    try:
        for log_format, check in (
            ("json", lambda text: json.loads(text)["message"] == "hello"),
            ("text", lambda text: text.endswith("INFO pgherd.test: hello")),
        ):
            stream = io.StringIO()
            logformat.configure(log_format, logging.INFO, stream=stream)
            assert len(root.handlers) == 1
            logging.getLogger("pgherd.test").info("hello")
            assert check(stream.getvalue().strip()), stream.getvalue()
        with pytest.raises(ValueError, match="expected one of text, json"):
            logformat.configure("yaml")
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
