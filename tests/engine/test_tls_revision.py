"""spec.tls and spec.superuserNetworkAccess: the agent reads them at start, so a change is a new spec
revision (a rolling restart), while their defaults leave every revision as it was before they existed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine.revision import spec_revision


def revision(**spec: object) -> str:
    return spec_revision(PostgresClusterSpec.model_validate({"instances": 3, **spec}), "img:1")


def test_the_defaults_keep_the_revision_of_before() -> None:
    before = revision()
    assert revision(tls={"minProtocolVersion": "TLSv1.3", "certificateLifetime": "30d"}) == before
    assert revision(superuserNetworkAccess=False) == before


def test_the_agent_flags_are_a_new_revision_and_the_lifetime_is_not() -> None:
    before = revision()
    assert revision(tls={"minProtocolVersion": "TLSv1.2"}) != before
    assert revision(superuserNetworkAccess=True) != before
    assert revision(tls={"certificateLifetime": "2160h"}) == before  # renewed, never a restart


@pytest.mark.parametrize("lifetime", ["4m", "0m", "300s", "0d", "826d", "1y", "90", "-1d"])
def test_a_lifetime_under_5_minutes_or_over_825_days_is_refused(lifetime: str) -> None:
    with pytest.raises(ValidationError, match=r"certificateLifetime|certificate_lifetime"):
        PostgresClusterSpec.model_validate({"tls": {"certificateLifetime": lifetime}})


def test_lifetimes() -> None:
    # Minutes are for tests that watch a renewal happen; 5m leaves the kubelet over 3 minutes to deliver one.
    for text, hours in (("5m", 1 / 12), ("30m", 0.5), ("1h", 1), ("2160h", 2160), ("90d", 2160), ("12w", 2016),
                        ("825d", 825 * 24)):  # fmt: skip
        spec = PostgresClusterSpec.model_validate({"tls": {"certificateLifetime": text}})
        assert spec.tls.lifetime.total_seconds() == hours * 3600
