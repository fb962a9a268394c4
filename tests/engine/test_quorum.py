"""The quorum resolver (sync standbys in safe steps) and the failover intersection invariant."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pgherd.engine.quorum import (
    ASYNC,
    QuorumError,
    SyncConfig,
    SyncStep,
    VotersStep,
    check,
    failover_keeps_commits,
    invariant_violation,
    majority,
    next_step,
    steady_config,
)

NAMES = [f"m{i}" for i in range(7)]


def test_render() -> None:
    assert SyncConfig(2, frozenset({"b", "a", "c"})).render() == 'ANY 2 ("a", "b", "c")'
    assert ASYNC.render() == ""


@pytest.mark.parametrize(("members", "k"), [(1, 0), (2, 1), (3, 1), (4, 2), (5, 2), (6, 3), (7, 3)])
def test_steady_k_makes_primary_plus_k_a_majority(members: int, k: int) -> None:
    config = steady_config(NAMES[:members], "m0", quorum=True)
    assert config.k == k
    assert 1 + config.k >= majority(members) or members == 1


@pytest.mark.parametrize("members", range(2, 8))
def test_any_reachable_majority_holds_every_acknowledged_commit(members: int) -> None:
    """The explicit invariant behind failover in quorum mode: with N members and ANY k of the N-1
    replicas (primary + k a majority), every majority of replicas intersects every ack set, so the
    member with the highest received LSN among them holds every acknowledged commit."""
    voters = NAMES[:members]
    config = steady_config(voters, "m0", quorum=True)
    replicas = voters[1:]
    for ack in combinations(sorted(config.standbys), config.k):
        for size in range(majority(members), len(replicas) + 1):
            for reachable in combinations(replicas, size):
                assert set(ack) & set(reachable), (ack, reachable)
                assert failover_keeps_commits(reachable, "m0", [config])


def test_failover_refused_when_reachable_replicas_may_miss_commits() -> None:
    config = SyncConfig(1, frozenset({"m1", "m2"}))
    assert not failover_keeps_commits(["m1"], "m0", [config, SyncConfig(2, frozenset({"m1", "m2", "m3"}))])
    assert not failover_keeps_commits(["m1"], "m0", [ASYNC])


def test_removing_two_voters_at_once_is_unsafe() -> None:
    voters = frozenset(NAMES[:5])
    config = steady_config(voters, "m0", quorum=True)
    assert invariant_violation(voters - {"m3", "m4"}, "m0", config) is not None
    assert invariant_violation(voters - {"m4"}, "m0", config) is None


def test_widening_without_raising_k_is_unsafe() -> None:
    voters = frozenset(NAMES[:3])
    wide = SyncConfig(1, frozenset({"m1", "m2", "m3", "m4"}))
    with pytest.raises(QuorumError):
        check(voters | {"m3", "m4"}, "m0", [wide])


def _walk(voters: frozenset[str], config: SyncConfig, wanted: frozenset[str]) -> list[object]:
    steps: list[object] = []
    for _ in range(64):
        step = next_step(voters, "m0", config, wanted, quorum=True)
        if step is None:
            return steps
        steps.append(step)
        if isinstance(step, VotersStep):
            check(step.voters, "m0", [config])  # the config in force with the new voters
            voters = step.voters
        else:
            assert isinstance(step, SyncStep)
            check(voters, "m0", [config, step.config])  # both may be in force until confirmed
            config = step.config
    raise AssertionError("no convergence")


def test_scale_up_raises_k_and_widens_before_counting_the_new_member() -> None:
    voters = frozenset(NAMES[:3])
    steps = _walk(voters, steady_config(voters, "m0", True), voters | {"m3"})
    assert steps == [
        SyncStep(SyncConfig(2, frozenset({"m1", "m2", "m3"}))),
        VotersStep(voters | {"m3"}),
    ]


def test_scale_down_drops_the_voter_before_narrowing() -> None:
    voters = frozenset(NAMES[:4])
    steps = _walk(voters, steady_config(voters, "m0", True), frozenset(NAMES[:3]))
    assert steps == [VotersStep(frozenset(NAMES[:3])), SyncStep(SyncConfig(1, frozenset({"m1", "m2"})))]


@given(
    start=st.sets(st.sampled_from(NAMES[1:]), max_size=6),
    wanted=st.sets(st.sampled_from(NAMES[1:]), max_size=6),
)
def test_every_path_keeps_the_invariant_and_converges(start: set[str], wanted: set[str]) -> None:
    voters = frozenset(start | {"m0"})
    _walk(voters, steady_config(voters, "m0", True), frozenset(wanted | {"m0"}))


@given(
    start=st.sets(st.sampled_from(NAMES[1:]), max_size=6),
    changes=st.lists(st.sets(st.sampled_from(NAMES[1:]), max_size=6), max_size=6),
    cut=st.lists(st.integers(min_value=0, max_value=3), max_size=6),
)
def test_changing_the_goal_midway_keeps_the_invariant(
    start: set[str], changes: list[set[str]], cut: list[int]
) -> None:
    """The wanted membership changes while a transition is under way (members join and fail)."""
    voters = frozenset(start | {"m0"})
    config = steady_config(voters, "m0", True)
    for wanted, steps in zip(changes, cut, strict=False):
        for _ in range(steps):
            step = next_step(voters, "m0", config, frozenset(wanted | {"m0"}), quorum=True)
            if step is None:
                break
            if isinstance(step, VotersStep):
                check(step.voters, "m0", [config])
                voters = step.voters
            else:
                assert isinstance(step, SyncStep)
                check(voters, "m0", [config, step.config])
                config = step.config


def test_async_mode_clears_sync_and_follows_membership() -> None:
    voters = frozenset(NAMES[:3])
    config = steady_config(voters, "m0", True)
    assert next_step(voters, "m0", config, voters, quorum=False) == SyncStep(ASYNC)
    assert next_step(voters, "m0", ASYNC, voters | {"m3"}, quorum=False) == VotersStep(voters | {"m3"})
