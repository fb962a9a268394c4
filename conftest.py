"""Every test report of this repository (tests/ and e2e/) with passwords masked: pytest prints the
arguments of each frame of a failure, and a DSN argument carries its password into CI's log."""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import Any

import pytest

# key=value conninfo (quoted or not), and the user:password@ of a URI
_SECRETS = (
    (re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s'\",]+)", re.IGNORECASE), r"\1***"),
    (re.compile(r"(://[^:/@\s'\"]+:)[^@\s'\"]+@"), r"\1***@"),
)


def mask(text: str) -> str:
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if report.longrepr is not None and not isinstance(report.longrepr, tuple):
        text = str(report.longrepr)
        masked = mask(text)
        if masked != text:
            report.longrepr = masked
