"""The operator's credential: a per-cluster bearer token (`Authorization: Bearer <token>`).

Compared in constant time, so that response timing tells a caller nothing about how much of a guess
was right. 401 when no credential came (the caller must authenticate), 403 when it is wrong.

The agent may hold the token itself or only its digest, `sha256:<hex>` (`pgherd instance certs` writes
both): with the digest, a member pod that is compromised does not hold the operator's credential.
"""

from __future__ import annotations

import hashlib
import hmac
from enum import IntEnum

DIGEST_PREFIX = "sha256:"


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
    offered = given.strip().encode()
    if token.startswith(DIGEST_PREFIX):
        expected = token.removeprefix(DIGEST_PREFIX).strip().lower().encode()
        offered = hashlib.sha256(offered).hexdigest().encode()
    else:
        expected = token.encode()
    return Verdict.ALLOWED if hmac.compare_digest(offered, expected) else Verdict.WRONG


def token_digest(token: str) -> str:
    """What a member may hold instead of the token: `sha256:<hex>`."""
    return DIGEST_PREFIX + hashlib.sha256(token.strip().encode()).hexdigest()
