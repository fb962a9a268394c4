"""These tests import the e2e.localkube package: the repository root goes on sys.path (the `pytest`
script, unlike `python -m pytest`, does not put the working directory there)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
