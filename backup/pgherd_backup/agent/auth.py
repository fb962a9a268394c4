"""The operator's credential: a per-cluster bearer token (`Authorization: Bearer <token>`).

Compared in constant time, so that response timing tells a caller nothing about how much of a guess
was right. 401 when no credential came (the caller must authenticate), 403 when it is wrong.
"""

from __future__ import annotations

import hmac
from enum import IntEnum


class Verdict(IntEnum):
    ALLOWED = 200
    MISSING = 401
    WRONG = 403


def check_bearer(authorization: str | None, token: str) -> Verdict:
    """The verdict on an Authorization header value against the expected token."""
    if not authorization:
        return Verdict.MISSING
    scheme, _, given = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return Verdict.MISSING
    if not token:  # never accept anything against an empty token
        return Verdict.WRONG
    if hmac.compare_digest(given.strip().encode(), token.encode()):
        return Verdict.ALLOWED
    return Verdict.WRONG
