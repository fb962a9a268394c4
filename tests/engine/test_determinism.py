"""The same inputs give the same decisions under any PYTHONHASHSEED (issue #10, item 3)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _history(seed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine.history"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return result.stdout.splitlines()


def test_a_scripted_history_decides_the_same_under_different_hash_seeds() -> None:
    first, second = _history("1"), _history("2")
    assert len(first) > 100, "the history should exercise the engine"
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        assert a == b, f"decision {index} differs between hash seeds"
