"""The MajorUpgrade operation, driven through the simulated cluster (model.py) with commits going on:
the preflight (a Backup, pg_upgrade --check) refused with the cluster untouched, the upgrade with one
replica kept on the old major until confirmed, a failure after writes stopped rolled back to it with
nothing acknowledged lost, a person's rollback after writes resumed, and an operator that crashes
between its status write and its actions at every pass."""

from __future__ import annotations

from dataclasses import replace

from pgherd.api.cluster import Phase, PrimaryUpdateMethod
from pgherd.engine.conditions import ConditionType
from pgherd.engine.status import OperationKind
from pgherd.engine.view import BackupView, RestoreView

from .test_properties import ClusterMachine

OLD, NEW = 16, 17


def machine(instances: int = 3, quorum: bool = True) -> ClusterMachine:
    m = ClusterMachine()
    m.setup(instances=instances, quorum=quorum, method=PrimaryUpdateMethod.SWITCHOVER, restore_on_loss=False)
    assert m.last is not None and m.last.phase is Phase.RUNNING, m.last
    assert {n.major for n in m.model.nodes.values()} == {OLD}
    return m


def raise_major(m: ClusterMachine, major: int = NEW) -> None:
    m.spec = m.spec.model_copy(update={"postgres_version": major})


def passes(m: ClusterMachine, count: int, *, applied: int = 100, commits: bool = True) -> list[Phase]:
    """Operator passes, a commit before each (to every member streaming), Jobs finishing."""
    phases = []
    for _ in range(count):
        if commits:
            m.model.commit(set(m.model.nodes))
        m.model.tick(1)
        m._operator_step(apply_all=applied >= 100, applied=applied)
        m.model.catch_up_all()
        m.model.finish_jobs(True)
        assert m.last is not None
        phases.append(m.last.phase)
    return phases


def reached(m: ClusterMachine) -> tuple[bool | None, str]:
    assert m.last is not None
    found = m.last.condition(ConditionType.POSTGRES_VERSION_REACHED)
    assert found is not None
    return found.status, found.reason


def until(m: ClusterMachine, done, limit: int = 80, **kwargs) -> None:
    for _ in range(limit):
        passes(m, 1, **kwargs)
        if done():
            return
    raise AssertionError(f"not done after {limit} passes: {m.last}")


def upgraded(m: ClusterMachine) -> bool:
    return m.status.operation is None and m.status.kept is not None


def test_upgrade_keeps_one_replica_on_the_old_major_until_confirmed() -> None:
    m = machine()
    primary = m.status.current_primary
    raise_major(m)
    until(m, lambda: upgraded(m))
    assert m.status.major == NEW and m.status.current_primary == primary
    kept = m.model.nodes[m.status.kept.member]
    assert (kept.major, kept.fenced, kept.running) == (OLD, True, False)
    others = [n for n in m.model.nodes.values() if n.name != kept.name]
    assert {n.major for n in others} == {NEW}
    assert m.model.upgrades == [(primary, NEW)]  # pg_upgrade ran on the primary only
    assert reached(m) == (True, "OldMajorKept")
    # the cluster works on: commits acknowledged by the quorum of the new major's members
    before = set(m.model.acked)
    passes(m, 10)
    assert m.model.acked > before and m.last.phase is Phase.RUNNING
    assert m.model.nodes[kept.name].major == OLD  # untouched all along
    m.model.confirm_upgrade = str(NEW)
    until(m, lambda: m.model.nodes[kept.name].major == NEW and m.last.phase is Phase.RUNNING)
    assert m.status.kept is None and reached(m) == (True, "Reached")


def test_a_refused_preflight_leaves_the_cluster_serving_writes_then_a_retry_upgrades() -> None:
    m = machine()
    primary = m.status.current_primary
    m.model.check_fails = True
    raise_major(m)
    for _ in range(30):
        passes(m, 1)
        node = m.model.nodes[primary]
        assert node.writable and not node.fenced, "writes stopped during a preflight"
        assert all(not n.fenced for n in m.model.nodes.values())
    assert m.status.major == OLD and m.status.operation is None
    assert reached(m) == (False, "UpgradeRefused")
    assert m.last.phase is Phase.RUNNING
    assert m.model.upgrades == [] and {n.major for n in m.model.nodes.values()} == {OLD}
    # the same spec again: never retried on its own
    passes(m, 10)
    assert m.status.operation is None and m.model.upgrades == []
    m.model.check_fails = False
    m.model.retry_upgrade = "1"
    until(m, lambda: upgraded(m))
    assert m.status.major == NEW


def _rolled_back(m: ClusterMachine, fault: str) -> None:
    primary = m.status.current_primary
    m.model.upgrade_fails = fault
    raise_major(m)
    until(m, lambda: m.status.aborted is not None and m.status.operation is None)
    kept = m.status.aborted.kept
    assert m.status.current_primary == kept != primary
    assert m.status.major == OLD and m.model.nodes[kept].writable and m.model.nodes[kept].major == OLD
    assert reached(m) == (False, "RolledBack")
    # nothing acknowledged is lost (the invariant checks it at every pass), and writes go on on OLD
    before = set(m.model.acked)
    until(m, lambda: m.last.phase is Phase.RUNNING)
    passes(m, 5)
    assert m.model.acked > before
    assert not (before - set(m.model.nodes[kept].wal))
    assert {n.major for n in m.model.nodes.values()} == {OLD}  # the upgraded member re-cloned
    # the spec still asks for NEW: not retried until asked
    passes(m, 10)
    assert m.status.major == OLD


def test_pg_upgrade_failing_rolls_back_to_the_kept_replica() -> None:
    _rolled_back(machine(), "pg_upgrade")


def test_the_new_major_failing_its_checks_rolls_back_to_the_kept_replica() -> None:
    _rolled_back(machine(quorum=False), "verify")


def test_a_person_rolls_back_after_writes_resumed_on_the_new_major() -> None:
    m = machine()
    raise_major(m)
    until(m, lambda: upgraded(m))
    kept = m.status.kept.member
    passes(m, 5)  # writes on the new major
    m.model.rollback_upgrade = str(NEW)
    until(m, lambda: m.status.current_primary == kept and m.last.phase is Phase.RUNNING)
    until(m, lambda: {n.major for n in m.model.nodes.values()} == {OLD})
    assert m.status.major == OLD and reached(m) == (False, "RolledBack")
    assert m.status.aborted is not None and m.status.aborted.kind is OperationKind.MAJOR_UPGRADE
    assert {n.major for n in m.model.nodes.values()} == {OLD}
    assert sum(n.kept_aside for n in m.model.nodes.values()) >= 1  # the new major's data, kept aside


def test_an_operator_crashing_mid_way_resumes_from_the_recorded_operation() -> None:
    """At every pass only the first few actions are applied (the operator dies after its status write),
    and every other pass decides on the previous view: the upgrade still completes, exactly once."""
    m = machine()
    raise_major(m)
    for i in range(300):
        m.model.commit(set(m.model.nodes))
        m.model.tick(1)
        m._operator_step(applied=i % 3, stale=i % 2 == 1)
        m.model.catch_up_all()
        m.model.finish_jobs(True)
        if upgraded(m):
            break
    until(m, lambda: upgraded(m))
    assert len(m.model.upgrades) == 1 and m.status.major == NEW


def test_a_single_instance_cluster_is_refused_with_the_way_out() -> None:
    m = machine(instances=1)
    raise_major(m)
    passes(m, 3)
    assert reached(m) == (False, "UpgradeRefused")
    assert "scale it to 2 or more" in str(m.status.aborted.failed)
    assert m.model.upgrades == []


def test_a_switchover_and_a_failover_while_the_old_major_is_kept_leave_it_alone() -> None:
    """Found by the property search: a switchover's end re-pointed every member at the new primary,
    the kept replica too (re-cloned onto the new major: the way back gone, then counted as a voter)."""
    m = machine()
    raise_major(m)
    until(m, lambda: upgraded(m))
    kept = m.status.kept.member
    other = next(n for n in m.model.nodes if n not in (kept, m.status.current_primary))
    m.model.switchover_to = other
    until(m, lambda: m.status.current_primary == other and m.last.phase is Phase.RUNNING)
    m.model.switchover_to = None
    node = m.model.nodes[kept]
    assert (node.major, node.fenced, node.running) == (OLD, True, False)
    assert kept not in m.status.voters
    # The new primary's pod is lost. With one of three members kept out, two voters remain: the quorum
    # is lost (docs/upgrades.md says so), nothing is promoted, the kept replica least of all.
    m.model.crash(m.model.nodes[other])
    until(m, lambda: m.last.phase is Phase.QUORUM_LOST)
    passes(m, 20)
    assert m.status.current_primary == other and m.model.promotions.count(kept) == 0
    node = m.model.nodes[kept]
    assert (node.major, node.fenced, node.running) == (OLD, True, False)
    m.model.restart(m.model.nodes[other])
    until(m, lambda: m.last.phase is Phase.RUNNING)


def test_a_recent_backup_is_reused_only_when_it_is_of_the_data_being_upgraded() -> None:
    """upgrade.backupMaxAge: a Completed Backup that young is the way back only if it holds this data (its
    major and its timeline): not one of the new major (taken after an earlier upgrade, before a restore
    brought the old major back), nor one of a history a restore or a failover left."""
    m = machine()
    upgrade = m.spec.upgrade.model_copy(update={"backup_max_age": "1h"})
    m.spec = m.spec.model_copy(update={"upgrade": upgrade})
    timeline = m.status.timeline
    assert timeline is not None
    unfit = {
        "of-the-new-major": BackupView("of-the-new-major", major=NEW, timeline=timeline),
        "of-another-history": BackupView("of-another-history", major=OLD, timeline=timeline + 1),
        "of-no-known-major": BackupView("of-no-known-major", timeline=timeline),
    }
    for name, view in unfit.items():
        m.model.backups[name] = replace(
            view, phase="Completed", created_at=m.model.now, completed_at=m.model.now
        )
    raise_major(m)
    until(m, lambda: m.status.operation is not None and m.status.operation.backup is not None)
    taken = str(m.status.operation.backup)
    assert taken not in unfit and "-pre-pg17-" in taken, taken
    until(m, lambda: upgraded(m))
    assert m.status.major == NEW

    m = machine()
    m.spec = m.spec.model_copy(update={"upgrade": upgrade})
    fit = BackupView(
        "fit", "Completed", created_at=m.model.now, completed_at=m.model.now, major=OLD, timeline=1
    )
    m.model.backups["fit"] = fit
    raise_major(m)
    until(m, lambda: m.status.operation is not None and m.status.operation.backup is not None)
    assert m.status.operation.backup == "fit"
    until(m, lambda: upgraded(m))
    assert set(m.model.backups) == {"fit"}  # no other Backup taken


def test_a_restore_of_the_old_major_stays_on_it_and_an_old_confirmation_confirms_nothing() -> None:
    """A Backup of the old major restored after the upgrade: the cluster runs the old major again and
    stays on it (recorded like a rollback, PostgresVersionReached False, reason Restored) until
    pgherd.io/retry-upgrade gets a new value; the upgrade then asked for keeps its way back although
    pgherd.io/confirm-upgrade still holds the value that confirmed the first one."""
    m = machine()
    primary = m.status.current_primary
    m.model.request_backup()
    until(m, lambda: m.model.backups["b0"].phase == "Completed")
    assert m.model.backups["b0"].major == OLD
    raise_major(m)
    until(m, lambda: upgraded(m))
    m.model.confirm_upgrade = str(NEW)
    until(m, lambda: m.status.kept is None and {n.major for n in m.model.nodes.values()} == {NEW})

    m.model.restores["r0"] = RestoreView("r0", backup="b0", created_at=m.model.now)
    until(m, lambda: m.model.restores["r0"].phase in ("Completed", "Failed") and m.status.operation is None)
    assert m.model.restores["r0"].phase == "Completed"
    until(m, lambda: {n.major for n in m.model.nodes.values()} == {OLD} and m.last.phase is Phase.RUNNING)
    assert m.status.major == OLD and reached(m) == (False, "Restored")
    passes(m, 15)
    assert m.status.major == OLD and m.status.operation is None  # never upgraded again on its own
    assert m.model.upgrades == [(primary, NEW)]

    m.model.retry_upgrade = "after-the-restore"
    until(m, lambda: upgraded(m))
    passes(m, 10)
    assert m.status.kept is not None, "an old confirmation released the way back of a new upgrade"
    assert reached(m) == (True, "OldMajorKept")
    m.model.confirm_upgrade = None  # removed, then set again: a confirmation of this upgrade
    passes(m, 1)
    m.model.confirm_upgrade = str(NEW)
    until(m, lambda: m.status.kept is None)
    assert reached(m)[0] is True
