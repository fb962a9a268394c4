"""How the operator and the agents write their logs (``--log-format``): ``text`` for a person, ``json`` for
a log pipeline, one object per line. Here, in the lower package, so that both use the same.

A JSON line holds ``time`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``, ``namespace``,
``cluster``, ``member`` (null where none applies) and ``message``; ``exception`` when one was logged.
Where the three names come from, the first found wins: the record's own (``extra={"member": ...}``),
the object a kopf record is about (``k8s_ref``: a PostgresCluster names the cluster), the context the
code runs in (``log_context``: a cluster's loop sets it for all it does, its tasks and threads
included), and the process's defaults (an agent knows its own).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from typing import Any, TextIO

from pgherd_backup.timestamps import rfc3339

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CLUSTER_KIND = "PostgresCluster"


@dataclass(frozen=True)
class LogContext:
    """Which object a log line is about; None: not applicable, or not known here."""

    namespace: str | None = None
    cluster: str | None = None
    member: str | None = None

    def over(self, base: LogContext) -> LogContext:
        """``base`` with the names this context sets."""
        given = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return replace(base, **given)


NOWHERE = LogContext()  # frozen: a safe default for the context variable
_CURRENT: ContextVar[LogContext] = ContextVar("pgherd_log_context", default=NOWHERE)


@contextmanager
def log_context(
    *, namespace: str | None = None, cluster: str | None = None, member: str | None = None
) -> Iterator[LogContext]:
    """Within the block (and the tasks and threads started from it: asyncio and ``to_thread`` copy the
    context), log lines name this namespace, cluster and member; the names not given stay as they were."""
    current = LogContext(namespace, cluster, member).over(_CURRENT.get())
    token = _CURRENT.set(current)
    try:
        yield current
    finally:
        _CURRENT.reset(token)


def current_context() -> LogContext:
    return _CURRENT.get()


def _kopf_object(record: logging.LogRecord) -> LogContext:
    """kopf's per-object records carry the object (``k8s_ref``: apiVersion, kind, name, namespace)."""
    ref = getattr(record, "k8s_ref", None)
    if not isinstance(ref, dict):
        return LogContext()
    namespace = ref.get("namespace") or None
    cluster = ref.get("name") if ref.get("kind") == CLUSTER_KIND else None
    return LogContext(namespace=namespace, cluster=cluster)


def _record_own(record: logging.LogRecord) -> LogContext:
    values = {name: getattr(record, name, None) for name in ("namespace", "cluster", "member")}
    return LogContext(**{k: str(v) for k, v in values.items() if v is not None})


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a message's own newlines are escaped)."""

    def __init__(self, defaults: LogContext | None = None) -> None:
        super().__init__()
        self.defaults = defaults or NOWHERE

    def where(self, record: logging.LogRecord) -> LogContext:
        where = self.defaults
        for layer in (_CURRENT.get(), _kopf_object(record), _record_own(record)):
            where = layer.over(where)
        return where

    def format(self, record: logging.LogRecord) -> str:
        where = self.where(record)
        doc: dict[str, Any] = {
            "time": rfc3339(datetime.fromtimestamp(record.created, UTC), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "namespace": where.namespace,
            "cluster": where.cluster,
            "member": where.member,
            "message": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            doc["exception"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


def formatter(log_format: str, defaults: LogContext | None = None) -> logging.Formatter:
    if log_format == "json":
        return JsonFormatter(defaults)
    if log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"log format {log_format!r}: expected one of {', '.join(FORMATS)}")


def configure(
    log_format: str,
    level: int = logging.INFO,
    *,
    defaults: LogContext | None = None,
    filters: Sequence[logging.Filter] = (),
    stream: TextIO | None = None,
) -> logging.Handler:
    """The root logger writes to ``stream`` (stderr) in ``log_format``, and nowhere else."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(log_format, defaults))
    for item in filters:
        handler.addFilter(item)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return handler
