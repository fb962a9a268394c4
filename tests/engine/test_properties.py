"""Property-based tests: random failure sequences against a model cluster, invariants after each step.

The state machine drives tests/engine/model.py with the engine as its operator. After every operator
step it checks the HA guarantees of DESIGN §4, stated in terms of what the members really do (the
model's truth), never what the engine believes; at the end it heals every fault and checks that the
cluster settles (liveness). Run a longer search with HYPOTHESIS_PROFILE=long (see conftest.py).

The operator may decide on a stale view (observed before the last faults) and its actions may be
applied late (after more faults) or cut short by a crash; a new operator pass drops what a crashed one
had not applied.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pgherd.api.cluster import Phase, PostgresClusterSpec, PrimaryUpdateMethod, ReplicationMode
from pgherd.engine import EngineStatus, decide
from pgherd.engine import actions as A
from pgherd.engine.plan import Decision
from pgherd.engine.quorum import majority
from pgherd.engine.rollout import PRIMARY_RESTART_TIMEOUT
from pgherd.engine.status import OperationKind
from pgherd.engine.view import ClusterView, Role

from .model import ModelCluster, Node, expected_names

NODES = st.integers(min_value=0, max_value=4)


class ClusterMachine(RuleBasedStateMachine):
    """One cluster, one operator (the engine), random faults and spec changes."""

    @initialize(
        instances=st.sampled_from([1, 3, 3, 4, 5]),
        quorum=st.booleans(),
        method=st.sampled_from(list(PrimaryUpdateMethod)),
        restore_on_loss=st.booleans(),
        fence_lags=st.booleans(),
        with_backup=st.booleans(),
    )
    def setup(
        self,
        instances: int,
        quorum: bool,
        method: PrimaryUpdateMethod,
        restore_on_loss: bool,
        fence_lags: bool = False,
        with_backup: bool = False,
    ) -> None:
        self.quorum = quorum
        self.images = 0
        self.spec = self._spec(instances, method, restore_on_loss)
        self.model = ModelCluster(self.spec, fence_lags=fence_lags)
        self.status = EngineStatus()
        self.last: Decision | None = None
        self.last_view: ClusterView | None = None
        self.pending: list[tuple[PostgresClusterSpec, ClusterView, EngineStatus, Decision, A.Action]] = []
        # The truth at the observations the last two decisions were taken on (distinct observations):
        # (observation number, {member: (streams from, sample was wrong, writable)}).
        self.observations = 0
        self.last_truth: tuple[int, dict[str, tuple[str | None, bool, bool]]] = (0, {})
        self.decided: list[tuple[int, dict[str, tuple[str | None, bool, bool]]]] = []
        self.cut_before_set_primary = False  # the next pass that re-points the rw endpoint crashes first
        # An aborted operation's old primary, owed a writable primary within a few full fresh passes.
        self.owed: tuple[str, int] | None = None
        for step in range(40):  # bring the cluster up, faults come later
            if with_backup and step == 20:  # a Completed backup, so that restores are reachable
                self.model.request_backup()
            if with_backup and step == 25:
                self.model.finish_jobs(True)
            self._operator_step(apply_all=True)
            self.model.catch_up_all()
            self.model.tick(1)

    def _spec(
        self, instances: int, method: PrimaryUpdateMethod, restore_on_loss: bool
    ) -> PostgresClusterSpec:
        mode = ReplicationMode.QUORUM if self.quorum else ReplicationMode.ASYNC
        return PostgresClusterSpec.model_validate(
            {
                "instances": instances,
                "replication": {"mode": mode},
                "failover": {"detectionSeconds": 3},
                "upgrade": {"primaryUpdateMethod": method},
                "image": f"img:{self.images}",
                "backup": {
                    "store": {"s3": {"bucket": "bkt", "credentials": {"secretName": "s3"}}},
                    "retention": {"keepLast": 2},
                },
                "recovery": {"onQuorumLoss": "RestoreFromBackup" if restore_on_loss else "Wait"},
            }
        )

    def _names(self) -> list[str]:
        return sorted(self.model.nodes)

    def _pick(self, index: int) -> str | None:
        names = self._names()
        return names[index % len(names)] if names else None

    # ---- the operator ------------------------------------------------------------------------
    def _operator_step(
        self, apply_all: bool = False, applied: int = 100, stale: bool = False, late: bool = False
    ) -> None:
        self.pending = []  # a new pass: whatever a crashed pass had not applied is gone
        fresh = self.model.observe()
        self.observations += 1
        fresh_truth = (self.observations, self.model.truth)
        use_stale = stale and self.last_view is not None
        view = self.last_view if use_stale and self.last_view is not None else fresh
        truth = self.last_truth if use_stale else fresh_truth
        self.last_view, self.last_truth = fresh, fresh_truth
        if not self.decided or self.decided[-1][0] != truth[0]:
            self.decided = [*self.decided[-1:], truth]
        before = self.status
        decision = decide(self.spec, view, before)
        assert decide(self.spec, view, before) == decision, "decide() is not deterministic"
        assert EngineStatus.from_dict(decision.status.to_dict()) == decision.status, "status round-trip"
        self._check_decision(view, before, decision)
        self.status = decision.status  # written before any action is applied
        self.last = decision
        self._clear_switchover_request(view, decision)
        count = len(decision.actions) if apply_all else min(applied, len(decision.actions))
        handover = [i for i, a in enumerate(decision.actions) if isinstance(a, A.SetPrimary)]
        if self.cut_before_set_primary and handover:
            self.cut_before_set_primary = False
            count = min(count, handover[0])  # the operator crashes right before re-pointing
        chosen = [(self.spec, view, before, decision, action) for action in decision.actions[:count]]
        if late and not apply_all:
            self.pending = chosen
            return
        for item in chosen:
            self._apply(*item)
        if count == len(decision.actions):
            self._check_after(before, decision, fresh=view is fresh)

    def _apply(
        self,
        spec: PostgresClusterSpec,
        view: ClusterView,
        before: EngineStatus,
        decision: Decision,
        action: A.Action,
    ) -> None:
        self._check_action(spec, view, before, decision, action)
        self.model.apply(action)
        self.one_writable_primary()

    def _check_decision(self, view: ClusterView, before: EngineStatus, decision: Decision) -> None:
        if not decision.actions and decision.phase is not Phase.RUNNING:
            assert decision.message, f"phase {decision.phase} with no action and no reason to wait"
        if decision.phase is Phase.QUORUM_LOST:
            assert not any(isinstance(a, A.Promote | A.StartRestore) for a in decision.actions)
        if decision.phase is Phase.RECOVERING:  # automatic restore only when configured
            assert self.spec.recovery.on_quorum_loss.value == "RestoreFromBackup"
        promotes = [a for a in decision.actions if isinstance(a, A.Promote)]
        assert len(promotes) <= 1
        restarts = [a for a in decision.actions if isinstance(a, A.RestartMember)]
        assert len(restarts) <= 1, "a rollout restarts one member at a time"

        started = decision.status.operation
        if (
            started is not None
            and started.kind is OperationKind.FAILOVER
            and started.source is not None
            and (
                before.operation is None
                or before.operation.kind is not OperationKind.FAILOVER
                or (before.operation.source, before.operation.started_at)
                != (started.source, started.started_at)
            )
        ):
            self._check_failure_confirmed(started.source, before)

    def _check_failure_confirmed(self, old: str, before: EngineStatus) -> None:
        """A failover starts only on a failure a majority of the voters really saw: each of them lost
        its WAL stream from ``old`` (or is ``old`` itself, no longer writable) at the observation the
        decision was taken on or at the one before; a member whose two samples were both wrong is
        excused (it reported a loss twice in a row: no rule could tell). One wrong sample is no vote.
        And an aborted operation's old primary, owed a resumption, is never failed over instead while it
        is available (see ``_available``)."""
        if self.owed is not None and self.owed[0] == old and self._available(old):
            raise AssertionError(f"the aborted operation's primary {old} was failed over, not resumed")
        if len(self.decided) < 2:
            return
        (_, previous), (_, current) = self.decided

        def lost(name: str, truth: dict[str, tuple[str | None, bool, bool]]) -> bool:
            if name not in truth:
                return True
            streams_from, _, writable = truth[name]
            return not writable if name == old else streams_from != old

        def wrong(name: str, truth: dict[str, tuple[str | None, bool, bool]]) -> bool:
            return name in truth and truth[name][1]

        voters = sorted(before.voters)
        saw = [
            n
            for n in voters
            if lost(n, current) or lost(n, previous) or (wrong(n, current) and wrong(n, previous))
        ]
        needed = 1 if len(voters) == 2 and not self.quorum else majority(len(voters))
        assert len(saw) >= needed, (
            f"failover from {old} confirmed by samples: only {saw} of the voters {voters} lost it"
        )

    def _clear_switchover_request(self, view: ClusterView, decision: Decision) -> None:
        """The adapter removes a switchover request once it is done or refused (kube/loop.py)."""
        target = view.switchover_to
        if target is None or self.model.switchover_to != target:
            return
        status = decision.status
        done = status.current_primary == target and status.operation is None
        aborted = status.aborted
        refused = (
            aborted is not None and aborted.kind is OperationKind.SWITCHOVER and aborted.target == target
        )
        if done or refused:
            self.model.switchover_to = None

    def _planned_restart(self, before: EngineStatus) -> bool:
        operation = before.operation
        if operation is None or operation.kind is not OperationKind.ROLLOUT:
            return False
        if operation.step != "restart-primary" or operation.step_started_at is None:
            return False
        return bool(self.model.now - operation.step_started_at <= PRIMARY_RESTART_TIMEOUT)

    def _check_after(self, before: EngineStatus, decision: Decision, fresh: bool) -> None:
        """After every action of a decision was applied. An aborted operation must leave a writable
        primary when its old primary is available: at once, or within three full passes on fresh
        views (the old primary may have come back read-only meanwhile, and is promoted in place)."""
        if self.owed is not None and fresh:
            name, passes = self.owed
            if self.model.writable_nodes() or not self._available(name):
                self.owed = None
            elif passes <= 1:
                raise AssertionError(f"an aborted operation left no writable primary ({name})")
            else:
                self.owed = (name, passes - 1)
        aborted = decision.status.aborted
        source = aborted.source if aborted is not None and aborted is not before.aborted else None
        if source is not None and self._available(source) and not self.model.writable_nodes():
            self.owed = (source, 3)

    def _available(self, name: str) -> bool:
        """The recorded primary could serve again through the engine's own actions: it runs, or the
        engine itself stopped it (fenced); its host and volume are fine and the operator sees it. A
        crashed member (stopped, not fenced) excuses the engine: only the platform restarts it. So does
        a lost pod, fenced or not: no agent answers for it, and an Unfence (a call to its agent, as in
        kube/actions.py) cannot reach it until the platform starts the pod again."""
        node = self.model.nodes.get(name)
        return (
            node is not None
            and node.pod_up
            and (node.running or node.fenced)
            and not (node.isolated or node.partitioned or node.data_lost)
            and node.restarting_to is None
            and not node.terminating
            and self.status.current_primary == name
        )

    def _check_action(
        self,
        spec: PostgresClusterSpec,
        view: ClusterView,
        before: EngineStatus,
        decision: Decision,
        action: A.Action,
    ) -> None:
        """Checks an action against the spec it was decided with (it may be applied late)."""
        model = self.model
        requested = decision.phase is Phase.RESTORING  # a person's Restore overrides the rollout
        if not requested and (
            isinstance(action, A.Fence | A.StartRestore)
            or (isinstance(action, A.Promote) and action.member != before.current_primary)
        ):
            assert not self._planned_restart(before), (
                f"{type(action).__name__} {action} during a planned restart of the primary"
            )
        if isinstance(action, A.DeleteMember):
            node = model.nodes.get(action.member)
            assert node is None or not node.kept_aside or action.keep_data, (
                f"deleting {action.member}'s volume, which holds kept-aside data"
            )
        if isinstance(action, A.StartRestore) and decision.phase is Phase.RECOVERING:
            lost = [n for n in before.voters if model.data_gone(n)]
            assert len(lost) >= majority(len(before.voters)), (
                f"automatic restore while a majority's data may exist (lost: {sorted(lost)})"
            )
        if isinstance(action, A.Promote):
            recovering = decision.phase in (Phase.RESTORING, Phase.RECOVERING)
            node = model.nodes.get(action.member)
            if recovering or node is None or node.role is Role.PRIMARY or not node.running:
                return
            assert not [n for n in model.writable_nodes() if n.name != action.member], (
                "promote beside a running primary"
            )
            voters = before.voters
            reachable = [
                m
                for m in view.members
                if m.name in voters and m.reachable and (not m.fenced or m.role is Role.REPLICA)
            ]
            me = view.member(action.member)
            old = view.member(before.current_primary)
            # The operation as this decision recorded it: one decision can drain, see the target
            # caught up and promote.
            operation = decision.status.operation or before.operation
            reachable_names = {m.name for m in reachable}
            source = model.nodes.get(str(operation.source)) if operation is not None else None
            drained = (  # a switchover's cleanly stopped primary, whose final WAL the target holds
                operation is not None
                and operation.final_lsn is not None
                and operation.source not in reachable_names
                and me is not None
                and (
                    (me.most_wal or 0) >= operation.final_lsn
                    # as its view showed when it was chosen: a restarted target under-reports it now
                    or (
                        source is not None
                        and not source.running
                        and node.wal[: len(source.wal)] == source.wal
                    )
                )
            )
            gone = old is None or not old.exists or old.stopped
            two_async = len(voters) == 2 and not self.quorum and gone  # the operator breaks the tie
            count = len(reachable) + (1 if drained else 0)
            needed = 1 if two_async else majority(len(voters))
            # The recorded primary promoted again in place (it came back read-only): nothing else
            # can have been promoted, and it holds every commit it acknowledged (checked below).
            in_place = action.member == before.current_primary and (
                before.operation is None or before.operation.kind is OperationKind.ROLLOUT
            )
            assert in_place or count >= needed, "promotion without a reachable majority"
            assert me is not None and me.most_wal is not None
            # The target is chosen with the best knowledge when the promotion is decided; a Promote
            # issued again later (the first may have been applied) never changes its target.
            choosing = before.operation is None or before.operation.step not in (
                "promote",
                "switchover-promote",
            )
            same = [m for m in reachable if m.role is Role.REPLICA and m.timeline == me.timeline]
            best = max((m.most_wal or 0) for m in same)
            assert not choosing or in_place or me.most_wal >= best, (
                "promoted member does not have the most WAL"
            )
            if self.quorum:
                missing = model.acked - set(node.wal)
                assert not missing, (
                    f"promoting {action.member} would lose acknowledged commits {sorted(missing)}"
                )
            if operation is not None and operation.step.startswith("switchover"):
                # A switchover loses nothing, in any mode: the target holds all of the old primary's WAL.
                lacks = [c for c in source.wal if c not in set(node.wal)] if source is not None else []
                assert not lacks, f"switchover promotes {action.member} without {operation.source}'s {lacks}"
        if isinstance(action, A.RestartMember):
            node = model.nodes.get(action.member)
            down = [
                n.name
                for n in model.nodes.values()
                if n.restarting_to is not None and n.name != action.member
            ]
            assert not down, f"restarting {action.member} while {down} restart"
            if node is not None and node.writable:
                lone = spec.instances == 1  # no one to switch over to
                assert lone or spec.upgrade.primary_update_method is PrimaryUpdateMethod.RESTART, (
                    "the primary restarted in place with primaryUpdateMethod: switchover"
                )
                others = [
                    n for n in model.nodes.values() if n.name != node.name and n.revision != action.revision
                ]
                assert not [n for n in others if n.ordinal < spec.instances], (
                    "primary restarted before replicas"
                )
        if isinstance(action, A.DeleteMember):
            node = model.nodes.get(action.member)
            assert node is None or not node.writable, "scale-down removes the primary"
            assert action.member != before.current_primary
        if isinstance(action, A.StartRestore):
            assert decision.phase in (Phase.RESTORING, Phase.RECOVERING)

    @invariant()
    def one_writable_primary(self) -> None:
        if not hasattr(self, "model"):
            return
        writable = self.model.writable_nodes()
        assert len(writable) <= 1, f"two members accept writes: {[n.name for n in writable]}"

    @invariant()
    def old_major_kept_untouched(self) -> None:
        """The replica kept on the old major after an upgrade is never started, rejoined or re-cloned
        until the upgrade is confirmed or rolled back (a restore may take it: it rebuilds everything)."""
        if not hasattr(self, "model") or self.status.kept is None:
            return
        node = self.model.nodes.get(self.status.kept.member)
        if node is None or node.data_lost:
            return
        assert node.major == self.status.kept.major, f"{node.name} left PostgreSQL {self.status.kept.major}"
        assert not node.running, f"{node.name}, kept on the old major, runs"

    @invariant()
    def no_acknowledged_commit_lost(self) -> None:
        if not hasattr(self, "model") or not self.quorum:
            return
        for node in self.model.writable_nodes():
            if node.name == self.status.current_primary:
                missing = self.model.acked - set(node.wal)
                assert not missing, f"primary {node.name} lacks acknowledged commits {sorted(missing)}"

    # ---- rules -------------------------------------------------------------------------------
    @rule(
        applied=st.integers(min_value=0, max_value=6),
        seconds=st.sampled_from([0, 0.5, 1, 2, 4]),
        stale=st.booleans(),
        late=st.booleans(),
    )
    def operator(self, applied: int, seconds: float, stale: bool = False, late: bool = False) -> None:
        """One operator pass; ``applied`` < all simulates an operator crash mid-way (status kept);
        ``stale``: decided on the previous pass's view; ``late``: its actions wait for apply_late."""
        self.model.tick(seconds)
        self._operator_step(applied=applied, stale=stale, late=late)

    @rule()
    def apply_late(self) -> None:
        """The actions of the last pass are applied now, after whatever happened since."""
        pending, self.pending = self.pending, []
        for item in pending:
            self._apply(*item)

    @rule(rounds=st.integers(min_value=2, max_value=8), seconds=st.sampled_from([0.5, 1, 2]))
    def operator_rounds(self, rounds: int, seconds: float) -> None:
        """Several full operator passes in a row (multi-step operations move on)."""
        for _ in range(rounds):
            self.model.tick(seconds)
            self._operator_step(apply_all=True)

    @rule(
        receivers=st.sets(NODES, max_size=5),
        count=st.integers(min_value=2, max_value=6),
        lagging=st.sets(NODES, max_size=3),
    )
    def commit_burst(self, receivers: set[int], count: int, lagging: set[int]) -> None:
        """Several commits, some members lagging behind (they stream later, or never)."""
        names = self._names()
        got = {names[i % len(names)] for i in sorted(receivers)} if names else set()
        behind = {names[i % len(names)] for i in sorted(lagging)} if names else set()
        for _ in range(count):
            self.model.commit(got - behind)

    @rule(seconds=st.sampled_from([10, 20, 45, 700]))
    def long_wait(self, seconds: float) -> None:
        """Time passes with no operator pass in between: detection, grace periods, step timeouts."""
        self.model.tick(seconds)
        self._operator_step(apply_all=True)

    @rule(receivers=st.sets(NODES, max_size=5), which=st.integers(min_value=0, max_value=1))
    def commit(self, receivers: set[int], which: int = 0) -> None:
        names = self._names()
        self.model.commit({names[i % len(names)] for i in sorted(receivers)} if names else set(), which)

    @rule(node=NODES, amount=st.integers(min_value=1, max_value=5))
    def stream(self, node: int, amount: int) -> None:
        name = self._pick(node)
        if name is not None:
            self.model.stream(name, amount)

    @rule(node=NODES)
    def crash(self, node: int) -> None:
        name = self._pick(node)
        if name is not None:
            self.model.crash(self.model.nodes[name])

    @rule(node=NODES)
    def restart(self, node: int) -> None:
        name = self._pick(node)
        if name is not None:
            self.model.restart(self.model.nodes[name])

    @rule(node=NODES)
    def wipe(self, node: int) -> None:
        """A member loses its volume."""
        name = self._pick(node)
        if name is not None:
            self.model.wipe(self.model.nodes[name])

    @rule(node=NODES)
    def terminate(self, node: int) -> None:
        """The member's pod is being deleted (drain, eviction): its agent reports it."""
        name = self._pick(node)
        if name is not None and self.model.nodes[name].running:
            self.model.nodes[name].terminating = True

    @rule()
    def end_terminations(self) -> None:
        self.model.end_terminations()

    @rule()
    def land_fences(self) -> None:
        self.model.land_fences()

    @rule(node=NODES)
    def settle(self, node: int) -> None:
        """A restarted replica has replayed its own WAL: its position is known again."""
        name = self._pick(node)
        if name is not None:
            self.model.nodes[name].unsettled = False

    @rule(node=NODES)
    def flap(self, node: int) -> None:
        """The next observation of this member's WAL receiver is wrong."""
        name = self._pick(node)
        if name is not None:
            self.model.nodes[name].flapped = True

    @rule(cut=st.booleans())
    def cut_all(self, cut: bool) -> None:
        """The operator loses (or regains) every member; they still see each other."""
        for node in self.model.nodes.values():
            node.partitioned = cut

    @rule(node=NODES, cut=st.booleans())
    def partition(self, node: int, cut: bool) -> None:
        name = self._pick(node)
        if name is not None:
            self.model.nodes[name].partitioned = cut

    @rule(node=NODES, cut=st.booleans())
    def isolate(self, node: int, cut: bool) -> None:
        name = self._pick(node)
        if name is not None:
            self.model.nodes[name].isolated = cut

    @rule(node=NODES, cut=st.booleans())
    def cut_off(self, node: int, cut: bool) -> None:
        """Its pod's network is cut from the operator and the other members (its kubelet still runs
        it): its replicas' receivers go silent, still saying streaming until their timeout."""
        name = self._pick(node)
        if name is not None:
            self.model.nodes[name].net_cut = cut

    @rule()
    def complete_restarts(self) -> None:
        self.model.complete_restarts()

    @rule(instances=st.sampled_from([1, 2, 3, 4, 5]))
    def scale(self, instances: int) -> None:
        if self.quorum and instances == 2:
            instances = 3  # refused by the API's CEL rule
        self.spec = self.spec.model_copy(update={"instances": instances})

    @rule()
    def new_image(self) -> None:
        self.images += 1
        self.spec = self.spec.model_copy(update={"image": f"img:{self.images}"})

    @rule()
    def raise_major(self) -> None:
        """spec.postgresVersion goes up by one (alone in its edit, as the API's CEL rules want)."""
        if self.spec.postgres_version < 18:
            self.spec = self.spec.model_copy(update={"postgres_version": self.spec.postgres_version + 1})

    @rule(word=st.sampled_from(["confirm", "rollback", "retry", "forget"]))
    def upgrade_annotation(self, word: str) -> None:
        """A person's pgherd.io/confirm-upgrade, rollback-upgrade (naming the spec's major) or a new
        retry-upgrade value; or the annotations removed."""
        major = str(self.spec.postgres_version)
        if word == "confirm":
            self.model.confirm_upgrade = major
        elif word == "rollback":
            self.model.rollback_upgrade = major
        elif word == "retry":
            self.model.retry_upgrade = self.model.now.isoformat()
        else:
            self.model.confirm_upgrade = self.model.rollback_upgrade = None

    @rule(fault=st.sampled_from(["check", "pg_upgrade", "verify"]))
    def upgrade_fault(self, fault: str) -> None:
        """The next upgrade check fails, or the next upgrade in pg_upgrade or in its checks."""
        if fault == "check":
            self.model.check_fails = not self.model.check_fails
        else:
            self.model.upgrade_fails = fault

    @rule()
    def request_backup(self) -> None:
        self.model.request_backup()

    @rule(succeed=st.booleans())
    def finish_jobs(self, succeed: bool) -> None:
        self.model.finish_jobs(succeed)

    @precondition(lambda self: hasattr(self, "model") and bool(self.model.backups))
    @rule()
    def request_restore(self) -> None:
        self.model.request_restore()

    # ---- scenarios: the event chains behind each finding of issue #10, with random parameters ----
    def _primary(self) -> Node | None:
        """The recorded primary when it really accepts writes and no operation runs."""
        node = self.model.nodes.get(self.status.current_primary or "")
        if node is None or not node.writable or node.isolated or self.status.operation is not None:
            return None
        return node

    def _passes(self, count: int, seconds: float) -> None:
        for _ in range(count):
            self.model.tick(seconds)
            self._operator_step(apply_all=True)

    @rule(
        drop=st.integers(min_value=2, max_value=3),
        count=st.integers(min_value=1, max_value=3),
        rounds=st.integers(min_value=3, max_value=10),
        fault=st.sampled_from(["crash", "isolate", "none"]),
        grow=st.booleans(),
    )
    def commits_on_leavers_then_scale_down(
        self, drop: int, count: int, rounds: int, fault: str, grow: bool = False
    ) -> None:
        """Item 1: commits acknowledged only by the members a scale-down then removes, the others
        lagging; the voters shrink by several members, then the primary fails. (``grow``: scaled up to
        five members first, all of them voters.)"""
        if grow and self._primary() is not None and self.spec.instances < 5:
            self.spec = self.spec.model_copy(update={"instances": 5})
            for _ in range(30):
                self.model.tick(1)
                self.model.catch_up_all()
                self._operator_step(apply_all=True)
                if len(self.status.voters) == 5 and self.status.sync_pending is None:
                    break
        primary = self._primary()
        instances = self.spec.instances
        if primary is None or instances < 4:
            return
        smaller = max(instances - drop, 3 if self.quorum else 1)
        leaving = {n for n, node in self.model.nodes.items() if node.ordinal >= smaller}
        for _ in range(count):
            self.model.commit(leaving)
        self.spec = self.spec.model_copy(update={"instances": smaller})
        self._passes(rounds, 1)
        if fault == "crash":
            self.model.crash(primary)
        elif fault == "isolate":
            primary.isolated = True
        if fault != "none":
            self._passes(rounds, 1)

    @rule(
        node=NODES,
        base=st.integers(min_value=2, max_value=6),
        ahead=st.integers(min_value=1, max_value=2),
        settled=st.sampled_from([True, True, False]),
        fault=st.sampled_from(["crash", "crash", "isolate"]),
        rounds=st.integers(min_value=2, max_value=10),
    )
    def replica_restarts_as_the_primary_dies(
        self, node: int, base: int, ahead: int, settled: bool, fault: str, rounds: int
    ) -> None:
        """Item 7: the replica with the most WAL restarts just before the primary dies; its receiver
        reports the segment start where streaming would resume, below the WAL it holds."""
        primary = self._primary()
        if primary is None:
            return
        replicas = sorted(n.name for n in self.model.nodes.values() if self.model.streaming(n))
        if len(replicas) < 2:
            return
        chosen = self.model.nodes[replicas[node % len(replicas)]]
        for _ in range(base):
            self.model.commit(set(replicas))
        for _ in range(ahead):
            self.model.commit({chosen.name})
        self.model.crash(chosen)
        self.model.restart(chosen)
        if fault == "crash":
            self.model.crash(primary)
        else:
            primary.isolated = True
        if settled:
            chosen.unsettled = False  # replayed its own WAL: it provably holds it
        self._passes(rounds, 1)

    @rule(
        node=NODES,
        base=st.integers(min_value=1, max_value=4),
        count=st.integers(min_value=1, max_value=3),
        skipped=st.sets(NODES, max_size=2),
        terminate=st.booleans(),
        rounds=st.integers(min_value=1, max_value=6),
    )
    def switchover_whose_stop_is_killed(
        self, node: int, base: int, count: int, skipped: set[int], terminate: bool, rounds: int
    ) -> None:
        """Item 6: a switchover (requested, or away from a terminating primary) whose fast shutdown of
        the primary times out and is killed: only an unclean final WAL position exists, behind the
        commits the target lacks."""
        primary = self._primary()
        if primary is None:
            return
        others = sorted(n for n in self.model.nodes if n != primary.name)
        if not others:
            return
        target = others[node % len(others)]
        for _ in range(base):
            self.model.commit(set(others))
        got = set(others) - {target} - {others[i % len(others)] for i in skipped}
        for _ in range(count):
            self.model.commit(got)
        primary.stop_hangs = True
        if terminate:
            primary.terminating = True
        else:
            self.model.switchover_to = target
        for _ in range(rounds):
            self.model.tick(0.5)
            self._operator_step(apply_all=True)
            self.model.land_fences()
        primary.stop_hangs = False

    @precondition(
        lambda self: (
            hasattr(self, "spec")
            and self.spec.upgrade.primary_update_method is PrimaryUpdateMethod.SWITCHOVER
            and self.spec.instances > 1
        )
    )
    @rule(
        how=st.sampled_from(["killed", "killed", "target-lost"]),
        after=st.integers(min_value=1, max_value=5),
    )
    def rollout_switchover_fails(self, how: str, after: int) -> None:
        """Item 9: a rolling update reaches its switchover, which fails (the primary's stop is killed,
        or the target is lost before it caught up): the rollout aborts and must resume the primary."""
        primary = self._primary()
        if primary is None:
            return
        primary.stop_hangs = how == "killed"
        if self._rollout_to("switchover-fence") and how == "target-lost":
            operation = self.status.operation
            target = self.model.nodes.get(str(operation.target)) if operation is not None else None
            if target is not None:
                self.model.crash(target)
        for _ in range(after):
            self.model.tick(0.5 if how == "killed" else 10)
            self.model.land_fences()
            self._operator_step(apply_all=True)
        primary.stop_hangs = False

    def _rollout_to(self, step: str) -> bool:
        """A new image, and the rollout driven (restarts completing, replicas streaming) until it
        reaches ``step``: True when it did."""
        self.new_image()
        for _ in range(60):
            self.model.tick(1)
            self.model.complete_restarts()
            self.model.catch_up_all()
            self._operator_step(apply_all=True)
            operation = self.status.operation
            if operation is None or operation.kind is not OperationKind.ROLLOUT:
                return False
            if operation.step == step:
                return True
        return False

    @precondition(
        lambda self: (
            hasattr(self, "spec")
            and (
                self.spec.upgrade.primary_update_method is PrimaryUpdateMethod.RESTART
                or self.spec.instances == 1
            )
        )
    )
    @rule(
        down=st.sampled_from([4, 8, 15, 30, 150]),
        step=st.sampled_from([0.5, 1, 2, 5]),
    )
    def planned_primary_restart_takes_long(self, down: int, step: float) -> None:
        """Item 5: a rolling update restarts the primary in place and it stays down for a while: its
        replicas lose it and vote, but a planned restart is no failure (past its bound, it is)."""
        if self._primary() is None or not self._rollout_to("restart-primary"):
            return
        waited = 0.0
        while waited < down:
            self.model.tick(step)
            waited += step
            self._operator_step(apply_all=True)
        self.model.complete_restarts()

    @precondition(
        lambda self: (
            hasattr(self, "model") and any(b.phase == "Completed" for b in self.model.backups.values())
        )
    )
    @rule(smaller=st.integers(min_value=1, max_value=4), rounds=st.integers(min_value=4, max_value=12))
    def restore_then_scale_down(self, smaller: int, rounds: int) -> None:
        """Item 10: a person restores the cluster (the rebuilt members keep their replaced data aside
        on their volumes), then scales it down: those volumes are never dropped."""
        if self._primary() is None:
            return
        self.model.request_restore()
        for _ in range(30):
            self.model.tick(1)
            self.model.finish_jobs(True)
            self.model.catch_up_all()
            self._operator_step(apply_all=True)
            if not [r for r in self.model.restores.values() if r.phase not in ("Completed", "Failed")]:
                break
        if self.quorum and smaller == 2:
            smaller = 3  # refused by the API's CEL rule
        self.spec = self.spec.model_copy(update={"instances": min(smaller, self.spec.instances)})
        for _ in range(rounds):
            self.model.tick(1)
            self.model.catch_up_all()
            self._operator_step(apply_all=True)

    @rule(
        two=st.booleans(),
        silent=st.sampled_from([3, 4, 6, 10]),
        lose_old=st.booleans(),
        back=st.booleans(),
    )
    def promotion_target_vanishes(self, two: bool, silent: int, lose_old: bool, back: bool) -> None:
        """Item 8: the primary dies, the failover promotes its target, and the target crashes before
        anyone saw it primary (with ``two``, in a cluster scaled to two async members; ``lose_old``:
        the old primary's volume is lost meanwhile). It comes back read-only, or not, later."""
        if two and not self.quorum and self._primary() is not None:
            self.spec = self.spec.model_copy(update={"instances": 2})
            self._passes(4, 1)
        primary = self._primary()
        if primary is None:
            return
        self.model.crash(primary)
        target = None
        for _ in range(12):
            self.model.tick(1)
            self._operator_step(apply_all=True)
            promoted = [a.member for a in self.last.actions if isinstance(a, A.Promote)] if self.last else []
            if promoted:
                target = self.model.nodes.get(promoted[0])
                break
        if target is None:
            return
        self.model.crash(target)
        if lose_old:
            self.model.wipe(primary)
        self._passes(silent, 1)
        if back:
            self.model.restart(target)
            self._passes(4, 1)

    @rule(node=NODES, rounds=st.integers(min_value=1, max_value=6))
    def handover_cut_short(self, node: int, rounds: int) -> None:
        """Found by the model: the operator crashes in the pass that records a new primary, before
        its SetPrimary: the rw endpoint still selects the old one (or none) until upkeep repairs it."""
        primary = self._primary()
        if primary is None:
            return
        others = sorted(n.name for n in self.model.nodes.values() if self.model.streaming(n))
        if not others:
            return
        self.model.switchover_to = others[node % len(others)]
        self.cut_before_set_primary = True
        for _ in range(8):
            self.model.tick(0.5)
            self.model.land_fences()
            self._operator_step(apply_all=True)
            if not self.cut_before_set_primary:
                break
        self.cut_before_set_primary = False
        self._passes(rounds, 1)

    @rule(
        wait=st.sampled_from([3, 4, 6]),
        samples=st.integers(min_value=1, max_value=3),
        flapping=st.sets(NODES, max_size=4),
        everyone=st.booleans(),
        heal=st.booleans(),
    )
    def votes_flap_while_the_primary_is_cut(
        self, wait: int, samples: int, flapping: set[int], everyone: bool, heal: bool
    ) -> None:
        """Item 12: the operator loses the primary while its replicas still stream from it, and their
        streaming samples flap: one wrong sample each must not confirm a failure."""
        primary = self._primary()
        if primary is None:
            return
        primary.partitioned = True
        self._passes(samples, wait / samples)
        replicas = sorted(n for n in self.model.nodes if n != primary.name)
        if not replicas:
            return
        chosen = set(replicas) if everyone else {replicas[i % len(replicas)] for i in flapping}
        for name in chosen:
            self.model.nodes[name].flapped = True
        self._passes(1, 1)
        if heal:
            primary.partitioned = False

    @precondition(lambda self: hasattr(self, "quorum") and not self.quorum)
    @rule(rounds=st.integers(min_value=2, max_value=8), wipe=st.booleans())
    def two_async_members_lose_the_primary(self, rounds: int, wipe: bool) -> None:
        """Item 12: scaled to two async members, the primary's volume is lost (or it crashes): the
        operator breaks the tie once the platform confirms it stopped; it never waits forever."""
        if self._primary() is None:
            return
        self.spec = self.spec.model_copy(update={"instances": 2})
        self._passes(rounds, 1)
        primary = self._primary()
        if primary is None or len(self.status.voters) != 2:
            return
        if wipe:
            self.model.wipe(primary)
        else:
            self.model.crash(primary)
        self._passes(rounds, 2)

    def _nothing_to_restore_from(self) -> bool:
        """QuorumLost is where a cluster rightly stays when the members whose data survives cannot
        form a majority, unless an automatic restore applies (policy RestoreFromBackup, a Completed
        backup, and a majority's data gone): only a person can act. Two async members are the
        exception: the operator breaks the tie, one surviving member is enough."""
        assert self.last is not None
        voters = self.status.voters
        lost = [n for n in voters if self.model.data_gone(n)]
        needed = 1 if len(voters) == 2 and not self.quorum else majority(len(voters))
        completed = any(b.phase == "Completed" for b in self.model.backups.values())
        restores = (
            self.spec.recovery.on_quorum_loss.value == "RestoreFromBackup"
            and completed
            and len(lost) >= majority(len(voters))
            and self.status.aborted is None
        )
        return self.last.phase is Phase.QUORUM_LOST and len(voters) - len(lost) < needed and not restores

    def teardown(self) -> None:
        """Liveness: with every fault healed, the cluster settles (Running, or Failed after an abort)."""
        if not hasattr(self, "model"):
            return
        model = self.model
        self.pending = []
        for node in model.nodes.values():
            node.partitioned = node.isolated = node.net_cut = False
            node.unsettled = node.flapped = False
        model.land_fences()
        model.end_terminations()
        for node in model.nodes.values():
            model.restart(node)
        model.complete_restarts()
        model.finish_jobs(True)
        phases = []
        for step in range(150):
            # One second at a time, then ten: waits bounded by the engine's own timeouts (a rollout
            # step's 10 minutes) end within the healing phase.
            model.tick(1 if step < 60 else 10)
            model.catch_up_all()
            model.complete_restarts()
            model.finish_jobs(True)
            model.land_fences()
            for node in model.nodes.values():
                model.restart(node)
                node.unsettled = False
            self._operator_step(apply_all=True)
            self.one_writable_primary()
            assert self.last is not None
            phases.append(self.last.phase)
            if self.last.phase is Phase.RUNNING and not self.last.actions:
                break
        assert self.last is not None
        settled = self.last.phase in (Phase.RUNNING, Phase.FAILED) or self._nothing_to_restore_from()
        assert settled, f"did not settle: {phases[-5:]} {self.last.message} {self.status}"
        if self.last.phase is Phase.RUNNING:
            names = {n for n in model.nodes}
            assert names == set(expected_names(self.spec.instances)), names
            assert model.rw == self.status.current_primary, (
                f"the rw endpoint selects {model.rw}, the primary is {self.status.current_primary}"
            )


TestCluster = ClusterMachine.TestCase
