"""A simulated PostgreSQL cluster that the engine drives, for property-based tests.

Each node's WAL is a list of commit ids (its LSN is the list's length), so "has this commit" is exact.
Commits are acknowledged as PostgreSQL would with the synchronous_standby_names in force on the
primary: by the primary plus any k of the listed standbys that received them. Faults: crashes,
restarts, operator<->member partitions (replication still flows), isolation (nothing flows), lag.
The model applies the engine's actions as an adapter would and records what the invariants need.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as A
from pgherd.engine.quorum import ASYNC, SyncConfig
from pgherd.engine.view import (
    BackupView,
    ClusterView,
    JobKind,
    JobState,
    JobView,
    MemberView,
    RestoreView,
    Role,
    member_name,
)

CLUSTER = "pg"
START = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class Node:
    name: str
    ordinal: int
    revision: str
    role: Role = Role.REPLICA
    timeline: int = 1
    wal: list[int] = field(default_factory=list)
    upstream: str | None = None
    running: bool = True
    partitioned: bool = False  # operator cannot reach it; replication unaffected
    isolated: bool = False  # nothing reaches it
    fenced: bool = False
    final_known: bool = False
    restarting_to: str | None = None  # down for a RestartMember until complete_restarts()
    sync: SyncConfig = field(default_factory=SyncConfig)
    kept_aside: int = 0

    @property
    def writable(self) -> bool:
        return self.running and self.role is Role.PRIMARY and not self.fenced


class InvariantError(AssertionError):
    pass


class ModelCluster:
    def __init__(self, spec: PostgresClusterSpec) -> None:
        self.spec = spec
        self.now = START
        self.nodes: dict[str, Node] = {}
        self.next_commit = 1
        self.next_timeline = 2
        self.acked: set[int] = set()
        self.rw: str | None = None
        self.backups: dict[str, BackupView] = {}
        self.backup_wal: dict[str, list[int]] = {}
        self.restores: dict[str, RestoreView] = {}
        self.jobs: dict[tuple[JobKind, str], JobView] = {}
        self.deleted: list[str] = []
        self.dropped_slots: list[str] = []
        self.pruned = 0
        self.restored = False
        self.promotions: list[str] = []

    # ---- observation -------------------------------------------------------------------------
    def reachable(self, node: Node) -> bool:
        return node.running and not node.partitioned and not node.isolated

    def streaming(self, node: Node) -> bool:
        up = self.nodes.get(node.upstream or "")
        return (
            node.running
            and not node.isolated
            and node.role is Role.REPLICA
            and not node.fenced
            and up is not None
            and up.writable
            and not up.isolated
            and node.timeline <= up.timeline
            and up.wal[: len(node.wal)] == node.wal
        )

    def observe(self) -> ClusterView:
        members = []
        for node in sorted(self.nodes.values(), key=lambda n: n.ordinal):
            if self.streaming(node):  # a streaming standby follows its upstream's timeline switches
                node.timeline = self.nodes[str(node.upstream)].timeline
            seen = self.reachable(node)
            final = len(node.wal) if node.fenced and node.final_known else None
            members.append(
                MemberView(
                    name=node.name,
                    ordinal=node.ordinal,
                    exists=True,
                    reachable=seen,
                    role=node.role if seen else Role.UNKNOWN,
                    timeline=node.timeline if seen else None,
                    received_lsn=len(node.wal) if seen else final,
                    replayed_lsn=len(node.wal) if seen else None,
                    wal_receiver_streaming=seen and self.streaming(node),
                    upstream=node.upstream if seen and node.role is Role.REPLICA else None,
                    ready=seen and (node.role is Role.PRIMARY or self.streaming(node)),
                    revision=node.revision,
                    fenced=node.fenced,
                    sync=node.sync if seen else None,
                )
            )
        return ClusterView(
            cluster=CLUSTER,
            now=self.now,
            members=tuple(members),
            backups=tuple(self.backups[k] for k in sorted(self.backups)),
            restores=tuple(self.restores[k] for k in sorted(self.restores)),
            jobs=tuple(self.jobs[k] for k in sorted(self.jobs)),
        )

    def writable_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.writable]

    # ---- the workload and the faults ---------------------------------------------------------
    def commit(self, receivers: set[str]) -> None:
        """One commit on the writable primary; ``receivers`` (if streaming and caught up) get it at once."""
        primaries = self.writable_nodes()
        if len(primaries) != 1:
            return
        primary = primaries[0]
        commit = self.next_commit
        self.next_commit += 1
        before = len(primary.wal)
        primary.wal.append(commit)
        got = {primary.name}
        for node in self.nodes.values():
            caught_up = node.upstream == primary.name and len(node.wal) == before
            if node.name in receivers and caught_up and self.streaming_from(node, primary, before):
                node.wal.append(commit)
                got.add(node.name)
        config = primary.sync
        standbys = (config.standbys - {primary.name}) & got
        if config.k == 0 or len(standbys) >= config.k:
            self.acked.add(commit)

    def streaming_from(self, node: Node, primary: Node, length: int) -> bool:
        return (
            node.running
            and not node.isolated
            and not primary.isolated
            and not node.fenced
            and node.role is Role.REPLICA
            and primary.wal[:length] == node.wal
        )

    def stream(self, name: str, amount: int) -> None:
        node = self.nodes.get(name)
        if node is None or not self.streaming(node):
            return
        up = self.nodes[str(node.upstream)]
        node.wal = up.wal[: min(len(up.wal), len(node.wal) + amount)]
        node.timeline = up.timeline

    def catch_up_all(self) -> None:
        for node in self.nodes.values():
            self.stream(node.name, 1 << 30)

    # ---- the adapter -------------------------------------------------------------------------
    def apply(self, action: A.Action) -> None:
        handler = getattr(self, f"_do_{type(action).__name__}")
        handler(action)

    def _node(self, name: str) -> Node | None:
        return self.nodes.get(name)

    def _do_CreateMember(self, a: A.CreateMember) -> None:
        if a.member in self.nodes:
            return
        if a.seed is A.Seed.BASEBACKUP:
            source = self._node(a.source or "")
            if source is None or not source.writable or source.isolated:
                return  # pg_basebackup fails; the engine will ask again
            self.nodes[a.member] = Node(
                a.member, a.ordinal, a.revision, Role.REPLICA, source.timeline, list(source.wal), source.name
            )
        else:
            self.nodes[a.member] = Node(a.member, a.ordinal, a.revision, Role.PRIMARY)

    def _do_DeleteMember(self, a: A.DeleteMember) -> None:
        if self.nodes.pop(a.member, None) is not None:
            self.deleted.append(a.member)

    def _do_RestartMember(self, a: A.RestartMember) -> None:
        node = self._node(a.member)
        if node is None or node.revision == a.revision or node.fenced:
            return
        node.running = False
        node.restarting_to = a.revision

    def complete_restarts(self) -> None:
        for node in self.nodes.values():
            if node.restarting_to is not None:
                node.revision = node.restarting_to
                node.restarting_to = None
                node.running = True

    def _do_Fence(self, a: A.Fence) -> None:
        node = self._node(a.member)
        if node is None or node.fenced:
            return
        if node.running and not node.isolated and node.role is Role.PRIMARY:
            # A clean shutdown: connected standbys receive all the WAL first.
            for other in self.nodes.values():
                if other.upstream == node.name and self.streaming_from(other, node, len(other.wal)):
                    other.wal = list(node.wal)
        node.final_known = node.running and not node.partitioned and not node.isolated
        node.fenced = True
        node.running = False
        node.restarting_to = None
        if self.rw == node.name:
            self.rw = None

    def _do_Unfence(self, a: A.Unfence) -> None:
        node = self._node(a.member)
        if node is None or not node.fenced:
            return
        node.fenced = False
        node.final_known = False
        node.running = node.restarting_to is None

    def _do_Demote(self, a: A.Demote) -> None:
        node = self._node(a.member)
        if node is None or not node.fenced or node.restarting_to is not None:
            return
        node.role = Role.REPLICA
        node.upstream = None
        node.running = True

    def _do_Promote(self, a: A.Promote) -> None:
        node = self._node(a.member)
        if node is None or not node.running or node.role is Role.PRIMARY:
            return
        node.fenced = False
        node.role = Role.PRIMARY
        node.timeline = self.next_timeline
        self.next_timeline += 1
        node.upstream = None
        self.promotions.append(node.name)

    def _do_SetPrimary(self, a: A.SetPrimary) -> None:
        self.rw = a.member

    def _do_SetSynchronousStandbys(self, a: A.SetSynchronousStandbys) -> None:
        node = self._node(a.member)
        if node is not None and node.running:
            node.sync = a.config

    def _do_Rejoin(self, a: A.Rejoin) -> None:
        node = self._node(a.member)
        up = self._node(a.upstream)
        if node is None or up is None or node.name == up.name:
            return
        if node.role is Role.PRIMARY and node.writable and node.name == self.rw:
            return
        if a.reclone:
            if not up.writable or up.isolated:
                return
            node.kept_aside += 1
            node.wal = list(up.wal)
        else:
            common = 0
            while common < min(len(node.wal), len(up.wal)) and node.wal[common] == up.wal[common]:
                common += 1
            node.wal = node.wal[:common]
        node.role = Role.REPLICA
        node.upstream = up.name
        node.timeline = up.timeline
        node.fenced = False
        node.final_known = False
        node.sync = ASYNC
        if node.restarting_to is None:
            node.running = True

    def _do_DropReplicationSlot(self, a: A.DropReplicationSlot) -> None:
        self.dropped_slots.append(a.slot)

    def _do_StartSnapshot(self, a: A.StartSnapshot) -> None:
        key = (JobKind.SNAPSHOT, a.backup)
        node = self._node(a.member)
        if key in self.jobs or node is None:
            return
        self.jobs[key] = JobView(JobKind.SNAPSHOT, a.backup, JobState.RUNNING, member=a.member)
        self.backup_wal[a.backup] = list(node.wal)

    def _do_StartRestore(self, a: A.StartRestore) -> None:
        key = (JobKind.RESTORE, a.restore)
        if key in self.jobs:
            return
        self.jobs[key] = JobView(JobKind.RESTORE, a.restore, JobState.RUNNING, member=a.member)
        self._restore_source = a.backup

    def finish_jobs(self, succeed: bool) -> None:
        for key, job in list(self.jobs.items()):
            if job.state is not JobState.RUNNING:
                continue
            state = JobState.SUCCEEDED if succeed else JobState.FAILED
            self.jobs[key] = replace(job, state=state, message="" if succeed else "simulated failure")
            if key[0] is JobKind.RESTORE and succeed:
                self._restored(job)

    def _restored(self, job: JobView) -> None:
        name = str(job.member)
        wal = list(self.backup_wal.get(getattr(self, "_restore_source", None) or "", []))
        node = self.nodes.get(name)
        if node is None:
            node = Node(name, int(name.rsplit("-", 1)[1]), "restored")
            self.nodes[name] = node
        else:
            node.kept_aside += 1
        node.wal = wal
        node.role = Role.PRIMARY
        node.timeline = self.next_timeline
        self.next_timeline += 1
        node.fenced = False
        node.running = True
        node.upstream = None
        node.sync = ASYNC
        self.acked = {c for c in self.acked if c in set(wal)}  # a restore keeps what the snapshot holds
        self.restored = True

    def _do_CreateBackup(self, a: A.CreateBackup) -> None:
        self.backups.setdefault(a.name, BackupView(a.name, created_at=self.now))

    def _do_UpdateBackup(self, a: A.UpdateBackup) -> None:
        old = self.backups.get(a.name)
        if old is not None:
            done = self.now if a.phase in ("Completed", "Failed") else None
            self.backups[a.name] = replace(
                old, phase=a.phase, source_member=a.source_member or old.source_member, completed_at=done
            )

    def _do_UpdateRestore(self, a: A.UpdateRestore) -> None:
        old = self.restores.get(a.name)
        if old is not None:
            self.restores[a.name] = replace(old, phase=a.phase)

    def _do_Prune(self, a: A.Prune) -> None:
        self.pruned += 1

    def _do_RecordEvent(self, a: A.RecordEvent) -> None:
        pass

    # ---- requests ----------------------------------------------------------------------------
    def request_backup(self) -> None:
        name = f"b{len(self.backups)}"
        self.backups[name] = BackupView(name, created_at=self.now)

    def request_restore(self) -> None:
        done = [b for b in self.backups.values() if b.phase == "Completed"]
        if not done:
            return
        name = f"r{len(self.restores)}"
        self.restores[name] = RestoreView(name, backup=done[-1].name, created_at=self.now)

    def tick(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def expected_names(instances: int) -> list[str]:
    return [member_name(CLUSTER, i) for i in range(instances)]
