"""One way to write a moment: RFC 3339 in UTC with a ``Z``, as the Kubernetes API server writes times."""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339(moment: datetime, digits: int = 0) -> str:
    """``2026-01-01T10:00:00Z``; with ``digits`` (3: milliseconds, 6: microseconds) of the second's
    fraction, ``2026-01-01T10:00:00.123Z``. A naive ``moment`` is taken as local time."""
    if not 0 <= digits <= 6:
        raise ValueError(f"digits must be 0 to 6, not {digits}")
    utc = moment.astimezone(UTC)
    fraction = f".{utc.microsecond:06d}"[: digits + 1] if digits else ""
    return f"{utc:%Y-%m-%dT%H:%M:%S}{fraction}Z"


def now_rfc3339(digits: int = 0) -> str:
    return rfc3339(datetime.now(UTC), digits)
