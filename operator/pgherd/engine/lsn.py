"""PostgreSQL WAL locations (LSN) as integers.

PostgreSQL prints an LSN as two hexadecimal halves, ``16/B374D848``. The engine compares LSNs, so it
works on plain integers (byte positions in the WAL stream); the adapters convert at the edges.
"""

from __future__ import annotations

import re

_LSN = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")


def parse_lsn(text: str) -> int:
    """``'16/B374D848'`` -> ``0x16B374D848``. Raises ValueError on anything else."""
    match = _LSN.match(text.strip())
    if match is None:
        raise ValueError(f"not a PostgreSQL LSN: {text!r} (expected e.g. 0/3000060)")
    return (int(match.group(1), 16) << 32) | int(match.group(2), 16)


def format_lsn(value: int) -> str:
    """``0x16B374D848`` -> ``'16/B374D848'``, as pg_current_wal_lsn() prints it."""
    if value < 0 or value >= 1 << 64:
        raise ValueError(f"LSN out of range: {value}")
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"
