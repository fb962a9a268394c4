"""A simulated PostgreSQL cluster that the engine drives, for property-based tests.

Each node's WAL is a list of commit ids (its LSN is the list's length), so "has this commit" is exact;
a promotion writes its end-of-recovery record (``-timeline``) on the new timeline. A replica reports
the timeline of the newest WAL it holds (as the adapters do: the receiver's, else its WAL segments'),
not the one it was told to follow.
Commits are acknowledged as PostgreSQL would with the synchronous_standby_names in force on the
primary at commit time: by the primary plus any k of the listed standbys that received them. Clients
write to every running primary they reach, fenced or not: "writable" is what PostgreSQL does, not what
the engine believes.

The model is no kinder than a real platform:
- a Fence is a request: with ``fence_lags`` the old primary keeps running (and taking writes) until the
  platform really stops it (``land_fences``), and an isolated node cannot be stopped at all;
- a crashed member is restarted by the platform read-only (a standby with no upstream), never as a
  primary; only Promote or RestartMember(primary=True) make a primary;
- after a restart a replica under-reports its received LSN and its provable WAL end is unknown until it
  has replayed its own WAL (``settle``); even then its WAL receiver reports the segment where streaming
  restarts (below the WAL it holds) until it streams again;
- a stop can time out and be killed (``stop_hangs``): no WAL handed to the standbys, an unclean
  shutdown whose final WAL end the platform cannot read exactly;
- a replica's "streaming" sample can be wrong for one observation (``flap``);
- a partition is silence, not a reset: a replica whose upstream (or itself) is isolated receives
  nothing, yet its receiver says streaming until wal_receiver_timeout (the real settings, from
  replication_timing), reporting only how long the upstream has been silent (``silent_since``); a live
  upstream is reported silent for up to half that timeout (its heartbeat);
- the operator can be cut off from any or all members while they still see each other (``partitioned``);
- a volume can be lost (``wipe``): the only evidence that allows an automatic restore; the fence kept
  on it goes with it, and the member's new pod starts empty and waits for the operator to seed it;
- a crashed member's pod is gone (``pod_up`` False) until the platform restarts it: no agent answers
  for it, so nothing can be fenced, rejoined or restored there; a fence reaches a member only through
  its running agent (and stays on its volume across restarts);
- decisions can be taken on a stale view and their actions applied late (see the state machine).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.engine import actions as A
from pgherd.engine.quorum import ASYNC, SyncConfig
from pgherd.engine.view import (
    ActionEnd,
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
from pgherd_backup.postgres.parameters import replication_timing

CLUSTER = "pg"
START = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class Node:
    name: str
    ordinal: int
    revision: str
    role: Role = Role.REPLICA
    timeline: int = 1  # a primary's; the timeline a replica follows
    wal: list[int] = field(default_factory=list)
    upstream: str | None = None
    running: bool = True
    pod_up: bool = True  # its agent runs (the platform reaches it unless isolated); False: pod lost
    partitioned: bool = False  # operator cannot reach it; replication unaffected
    isolated: bool = False  # nothing reaches it, not even the platform
    # Its pod's network is cut (from the operator and the other members) but its node's kubelet still
    # runs it: a fence lands by pod deletion; replication to and from it is silence.
    net_cut: bool = False
    fenced: bool = False  # the platform's flag: a Fence was asked and not undone
    fence_pending: bool = False  # asked, not yet carried out: still running
    shutdown_clean: bool | None = None  # how it last stopped
    restarting_to: str | None = None  # down for a RestartMember until complete_restarts()
    restart_as_primary: bool = False
    unsettled: bool = False  # restarted: received LSN under-reported, WAL end unknown
    receive_start: int | None = None  # restarted receiver: reports this segment start until it streams
    stop_hangs: bool = False  # its next shutdown times out and the platform kills it
    flapped: bool = False  # the next observation reports its streaming state wrongly
    silent_since: datetime | None = None  # its upstream went silent (isolated) under a live receiver
    data_lost: bool = False
    terminating: bool = False  # its pod is being deleted: stopped (cleanly) by end_terminations
    sync: SyncConfig = field(default_factory=SyncConfig)
    kept_aside: int = 0
    major: int = 16  # the major of its data directory
    last_action: ActionEnd | None = None  # how its last upgrade check / upgrade ended

    @property
    def silenced(self) -> bool:
        """Nothing of it reaches the other members, and the operator's calls to its agent time out."""
        return self.isolated or self.net_cut

    @property
    def writable(self) -> bool:
        """PostgreSQL accepts writes: a running primary, whatever the engine's flags say."""
        return self.running and self.role is Role.PRIMARY


class InvariantError(AssertionError):
    pass


class ModelCluster:
    def __init__(self, spec: PostgresClusterSpec, fence_lags: bool = False) -> None:
        self.spec = spec
        self.fence_lags = fence_lags
        self.now = START
        # wal_receiver_timeout / 2, as the members are configured for this detectionSeconds.
        timeout = replication_timing(spec.failover.detection_seconds)["wal_receiver_timeout"]
        self.heartbeat = int(timeout.removesuffix("s")) / 2
        self.nodes: dict[str, Node] = {}
        self.next_commit = 1
        self.next_timeline = 2
        self.acked: set[int] = set()
        self.commit_timeline: dict[int, int] = {}  # the timeline each commit was written on
        self.commit_major: dict[int, int] = {}  # the major each commit was written on
        self.rw: str | None = None
        self.backups: dict[str, BackupView] = {}
        self.backup_wal: dict[str, list[int]] = {}
        self.backup_major: dict[str, int] = {}  # the major each snapshot's data is on
        self.restores: dict[str, RestoreView] = {}
        self.jobs: dict[tuple[JobKind, str], JobView] = {}
        self.deleted: list[str] = []
        self.dropped_slots: list[str] = []
        self.pruned = 0
        self.restored = False
        self.promotions: list[str] = []
        self.deleted_kept_aside: list[str] = []
        self.dropped_volumes: set[str] = set()
        self.switchover_to: str | None = None  # a person's switchover request (the annotation)
        # Major upgrades: a person's annotations, and the faults of the next check / upgrade.
        self.confirm_upgrade: str | None = None
        self.rollback_upgrade: str | None = None
        self.retry_upgrade: str | None = None
        self.check_fails = False
        self.upgrade_fails: str | None = None  # "pg_upgrade" (old data intact) or "verify" (new major's)
        self.upgrades: list[tuple[str, int]] = []  # (member, major) of every upgrade carried out
        # The truth at the last observation, per member: the member it really streamed from (None if
        # not streaming), whether its streaming sample was wrong, whether it really accepted writes.
        self.truth: dict[str, tuple[str | None, bool, bool]] = {}

    # ---- observation -------------------------------------------------------------------------
    def reachable(self, node: Node) -> bool:
        return node.running and not node.partitioned and not node.silenced

    def streaming(self, node: Node, through_silence: bool = False) -> bool:
        """WAL really arrives from its upstream; `through_silence`: it would, were neither isolated."""
        up = self.nodes.get(node.upstream or "")
        return (
            node.running
            and (through_silence or not node.silenced)
            and node.role is Role.REPLICA
            and not node.fenced
            and up is not None
            and up.name != node.name
            and up.writable
            and (through_silence or not up.silenced)
            and node.timeline <= up.timeline
            and node.major == up.major
            and up.wal[: len(node.wal)] == node.wal
        )

    def receiver_report(self, node: Node) -> tuple[bool, float | None]:
        """What its receiver says: streaming, and how long its upstream has been silent. A stream cut by
        isolation still says streaming, ever more silent, until wal_receiver_timeout ends it."""
        if self.streaming(node):
            node.silent_since = None
            return True, self.heartbeat / 2
        if not self.streaming(node, through_silence=True):
            node.silent_since = None
            return False, None
        if node.silent_since is None:
            node.silent_since = self.now
        silence = (self.now - node.silent_since).total_seconds()
        # After the timeout the receiver is gone; its agent still knows when the upstream last spoke.
        return silence < 2 * self.heartbeat, silence

    def observe(self) -> ClusterView:
        members = []
        self.truth = {}
        for node in sorted(self.nodes.values(), key=lambda n: n.ordinal):
            if self.streaming(node):  # a streaming standby follows its upstream's timeline switches
                node.timeline = self.nodes[str(node.upstream)].timeline
                node.unsettled = False
                node.receive_start = None
            seen = self.reachable(node)
            # The platform sees the process gone and nothing about to start it: a member in the middle
            # of a RestartMember is not stopped (agentview: an action that may start it is running).
            stopped = not node.running and not node.isolated and node.restarting_to is None
            clean = node.shutdown_clean if stopped else None
            replayed: int | None = None
            if seen:
                # After a restart the receiver starts again at a segment boundary: under-reported,
                # also once the member has replayed (and so provably holds) its own WAL.
                start = node.receive_start if node.role is Role.REPLICA else None
                received: int | None = len(node.wal) if start is None else start
                replayed = received if node.unsettled else len(node.wal)
                held = None if node.unsettled else len(node.wal)
            elif stopped and not node.data_lost:
                # After a clean stop the final WAL end; after a crash what a platform may read there
                # (pg_control's last checkpoint, behind the end of WAL): the engine must not trust it.
                received = len(node.wal) if clean else len(node.wal) // 2
                held = len(node.wal)  # the platform reads the WAL on the stopped member's volume
            else:
                received = held = None
            truly = self.streaming(node)
            says, silence = self.receiver_report(node)
            streaming = seen and says
            self.truth[node.name] = (node.upstream if truly else None, node.flapped, node.writable)
            if node.flapped:
                streaming = seen and node.role is Role.REPLICA and not streaming
                node.flapped = False
            members.append(
                MemberView(
                    name=node.name,
                    ordinal=node.ordinal,
                    exists=True,
                    reachable=seen,
                    role=node.role if seen else Role.UNKNOWN,
                    timeline=self.wal_timeline(node) if seen else None,
                    received_lsn=received,
                    replayed_lsn=replayed,
                    held_lsn=held,
                    wal_receiver_streaming=streaming,
                    upstream=node.upstream if seen and node.role is Role.REPLICA else None,
                    upstream_silence=silence if seen else None,
                    upstream_heartbeat=self.heartbeat if streaming else None,
                    ready=seen and (node.role is Role.PRIMARY or says),
                    revision=node.revision,
                    fenced=node.fenced and node.pod_up,  # the agent's own report, or the last one
                    sync=node.sync if seen else None,
                    stopped=stopped,
                    shutdown_clean=clean,
                    data_present=not node.data_lost,
                    kept_aside=node.kept_aside,
                    terminating=seen and node.terminating,
                    absent=not node.pod_up and not node.isolated,
                    data_major=None if node.data_lost or not (seen or stopped) else node.major,
                    last_action=node.last_action if node.pod_up and not node.isolated else None,
                )
            )
        for name in sorted(self.dropped_volumes - set(self.nodes)):
            # The platform knows the member's volume is gone (no directory, no PVC): it says so.
            ordinal = int(name.rsplit("-", 1)[1])
            members.append(MemberView(name=name, ordinal=ordinal, exists=False, data_present=False))
        members.sort(key=lambda m: m.ordinal)
        return ClusterView(
            cluster=CLUSTER,
            now=self.now,
            members=tuple(members),
            backups=tuple(self.backups[k] for k in sorted(self.backups)),
            restores=tuple(self.restores[k] for k in sorted(self.restores)),
            jobs=tuple(self.jobs[k] for k in sorted(self.jobs)),
            rw_member=self.rw,
            switchover_to=self.switchover_to,
            confirm_upgrade=self.confirm_upgrade,
            rollback_upgrade=self.rollback_upgrade,
            retry_upgrade=self.retry_upgrade,
        )

    def wal_timeline(self, node: Node) -> int:
        """The timeline a member reports: a primary's own; a replica's newest WAL record's (with no
        record past the initial WAL of the cluster, the first timeline's)."""
        if node.role is Role.PRIMARY:
            return node.timeline
        if not node.wal:
            return 1
        last = node.wal[-1]
        return -last if last < 0 else self.commit_timeline.get(last, node.timeline)

    def data_gone(self, name: str) -> bool:
        """The truth about a member's data: its volume lost, or dropped by a deletion."""
        node = self.nodes.get(name)
        return node.data_lost if node is not None else name in self.dropped_volumes

    def writable_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.writable]

    # ---- the workload and the faults ---------------------------------------------------------
    def commit(self, receivers: set[str], which: int = 0) -> None:
        """One commit on a running primary (clients reach any, fenced or not); ``receivers`` (if
        streaming and caught up) get it at once."""
        primaries = sorted(self.writable_nodes(), key=lambda n: n.name)
        if not primaries:
            return
        primary = primaries[which % len(primaries)]
        commit = self.next_commit
        self.next_commit += 1
        self.commit_timeline[commit] = primary.timeline
        self.commit_major[commit] = primary.major
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
            and not node.silenced
            and not primary.silenced
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
            if source is None or not source.writable or source.silenced:
                return  # pg_basebackup fails; the engine will ask again
            self.nodes[a.member] = Node(
                a.member,
                a.ordinal,
                a.revision,
                Role.REPLICA,
                source.timeline,
                list(source.wal),
                source.name,
                major=source.major,
            )
        else:
            self.nodes[a.member] = Node(
                a.member, a.ordinal, a.revision, Role.PRIMARY, major=self.spec.postgres_version
            )

    def _do_DeleteMember(self, a: A.DeleteMember) -> None:
        node = self.nodes.pop(a.member, None)
        if node is not None:
            self.deleted.append(a.member)
            if not a.keep_data:
                self.dropped_volumes.add(a.member)
            if node.kept_aside and not a.keep_data:
                self.deleted_kept_aside.append(a.member)

    def _do_RestartMember(self, a: A.RestartMember) -> None:
        node = self._node(a.member)
        if node is None or node.revision == a.revision or node.fenced or not node.pod_up:
            return
        self._stop(node)
        node.restarting_to = a.revision
        node.restart_as_primary = a.primary

    def complete_restarts(self) -> None:
        for node in self.nodes.values():
            if node.restarting_to is not None:
                node.revision = node.restarting_to
                node.restarting_to = None
                self._boot(node, as_primary=node.restart_as_primary)

    def _stop(self, node: Node) -> None:
        """A clean shutdown where the platform reaches it: connected standbys receive all the WAL. One
        that hangs (``stop_hangs``) is killed when the fast shutdown times out: nothing handed over."""
        if node.running and not node.isolated and node.stop_hangs:
            node.stop_hangs = False
            self.crash(node, pod_lost=False)  # the agent kills its PostgreSQL
        elif node.running and not node.isolated:
            if node.role is Role.PRIMARY:
                for other in self.nodes.values():
                    if other.upstream == node.name and self.streaming_from(other, node, len(other.wal)):
                        other.wal = list(node.wal)
            node.running = False
            node.shutdown_clean = True

    def _boot(self, node: Node, as_primary: bool = False) -> None:
        """The platform starts a member: read-only unless the engine said otherwise."""
        if node.data_lost:
            return
        if node.role is Role.PRIMARY and not as_primary:
            node.role = Role.REPLICA
            node.upstream = None
        node.pod_up = True
        node.running = True
        node.unsettled = node.role is Role.REPLICA
        node.receive_start = len(node.wal) // 2 if node.unsettled else None

    def crash(self, node: Node, pod_lost: bool = True) -> None:
        """PostgreSQL dies; with ``pod_lost`` its agent too (a lost pod, until ``restart``). A restart in
        flight then ends read-only: the order to start read-write was its agent's (kube/actions.py
        restart_member, local/platform.py), gone with it; the new pod's agent starts a standby."""
        if node.running:
            node.running = False
            node.shutdown_clean = False
        if pod_lost and not node.isolated:
            node.pod_up = False
            node.restart_as_primary = False

    def restart(self, node: Node) -> None:
        """The platform's own restart of a dead member (a kubelet restarting a container): its agent
        starts PostgreSQL read-only, but keeps a fenced member stopped and an empty volume empty (seeded
        only when the operator says so)."""
        if node.restarting_to is not None or node.running or node.isolated:
            return
        node.pod_up = True
        if node.fenced or node.data_lost:
            return
        self._boot(node)

    def wipe(self, node: Node) -> None:
        """The member's volume is lost."""
        self.crash(node)
        node.running = False
        node.fenced = node.fence_pending = False  # the fence was kept on the lost volume
        node.data_lost = True
        node.wal = []
        node.role = Role.REPLICA

    def end_terminations(self) -> None:
        """The grace period ends: a terminating member stops cleanly and its new pod starts read-only."""
        for node in self.nodes.values():
            if node.terminating and not node.isolated:
                node.terminating = False
                self._stop(node)
                if not node.fenced:
                    self._boot(node)

    def land_fences(self) -> None:
        """The platform carries out the fences asked (it cannot reach an isolated node)."""
        for node in self.nodes.values():
            if node.fence_pending and not node.isolated:
                self._stop(node)
                node.fence_pending = False

    def _do_Fence(self, a: A.Fence) -> None:
        node = self._node(a.member)
        if node is None:
            return
        if not node.pod_up:
            if self.rw == node.name:
                self.rw = None
            return  # no agent to take it
        node.fenced = True
        node.restarting_to = None
        # Kubernetes: the -rw slice keeps a fenced member whose agent took the fence (its PostgreSQL is
        # stopped), and loses one whose agent the operator cannot reach (its pod is deleted).
        if self.rw == node.name and node.net_cut:
            self.rw = None
        if not node.running:
            return
        node.fence_pending = True
        if not self.fence_lags:
            self.land_fences()

    def _do_Unfence(self, a: A.Unfence) -> None:
        node = self._node(a.member)
        if node is None or not node.fenced or not node.pod_up or node.net_cut:
            return
        node.fenced = False
        node.fence_pending = False
        if not node.running and node.restarting_to is None and not node.isolated:
            self._boot(node, as_primary=True)  # the engine's explicit order: as it was

    def _do_Demote(self, a: A.Demote) -> None:
        node = self._node(a.member)
        if node is not None and self.rw == node.name:
            self.rw = None  # Kubernetes: out of the -rw slice before the read-only start
        if node is None or not node.fenced or node.restarting_to is not None or node.running:
            return
        if not node.pod_up:
            return
        if node.silenced or node.data_lost:
            return
        node.role = Role.REPLICA
        node.upstream = None
        node.running = True
        node.fence_pending = False

    def _do_Promote(self, a: A.Promote) -> None:
        node = self._node(a.member)
        if node is None or node.role is Role.PRIMARY:
            return
        if not node.running:
            # The agent starts a stopped member read-only with no upstream, then promotes it.
            if not node.pod_up or node.silenced or node.data_lost or node.restarting_to is not None:
                return
            node.running = True
            node.upstream = None
        if self.rollback_upgrade is not None:
            # A person asked for the way back: what was acknowledged on a newer major is not in it.
            self.acked = {c for c in self.acked if self.commit_major.get(c, node.major) <= node.major}
        node.fenced = False
        node.fence_pending = False
        node.unsettled = False
        node.receive_start = None
        node.role = Role.PRIMARY
        node.timeline = self.next_timeline
        self.next_timeline += 1
        node.wal.append(-node.timeline)  # the end-of-recovery record, on the new timeline
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
        if node.silenced or not node.pod_up or node.restarting_to is not None:
            return  # the platform cannot reach it, or it is busy restarting
        if node.data_lost or a.reclone or node.major != up.major:  # no pg_rewind across majors
            if not up.writable or up.silenced:
                return
            node.kept_aside += 0 if node.data_lost else 1
            node.data_lost = False
            node.wal = list(up.wal)
            node.major = up.major
        else:
            common = 0
            while common < min(len(node.wal), len(up.wal)) and node.wal[common] == up.wal[common]:
                common += 1
            node.wal = node.wal[:common]
        node.role = Role.REPLICA
        node.upstream = up.name
        node.timeline = up.timeline
        node.fenced = False
        node.fence_pending = False
        node.sync = ASYNC
        node.running = True
        node.unsettled = False
        node.receive_start = None

    def _do_DropReplicationSlot(self, a: A.DropReplicationSlot) -> None:
        self.dropped_slots.append(a.slot)

    def _do_StartSnapshot(self, a: A.StartSnapshot) -> None:
        key = (JobKind.SNAPSHOT, a.backup)
        node = self._node(a.member)
        if key in self.jobs or node is None:
            return
        self.jobs[key] = JobView(JobKind.SNAPSHOT, a.backup, JobState.RUNNING, member=a.member)
        self.backup_wal[a.backup] = list(node.wal)
        self.backup_major[a.backup] = node.major

    def _do_StartRestore(self, a: A.StartRestore) -> None:
        key = (JobKind.RESTORE, a.restore)
        if key in self.jobs:
            return
        node = self._node(a.member)
        if node is not None and (node.silenced or not node.pod_up or not (node.fenced or node.data_lost)):
            return  # its agent restores only when it answers, under a fence (an empty volume: fenced first)
        if node is not None:
            node.running = False  # its data directory is moved aside while the snapshot is fetched
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
        source = getattr(self, "_restore_source", None) or ""
        wal = list(self.backup_wal.get(source, []))
        node = self.nodes.get(name)
        if node is None:
            node = Node(name, int(name.rsplit("-", 1)[1]), "restored")
            self.nodes[name] = node
        elif not node.data_lost:
            node.kept_aside += 1
        node.data_lost = False
        node.fence_pending = False
        node.unsettled = False
        node.receive_start = None
        # Its PostgreSQL runs the restored data: its pod runs (a pod lost meanwhile was restarted, and
        # its agent resumed the replay, as agent/restoring.py does).
        node.pod_up = True
        node.role = Role.PRIMARY
        node.major = self.backup_major.get(source, node.major)  # restored by its own major's programs
        node.timeline = self.next_timeline
        self.next_timeline += 1
        node.wal = [*wal, -node.timeline]
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
            source = self.nodes.get(str(a.source_member or old.source_member))
            self.backups[a.name] = replace(
                old,
                phase=a.phase,
                source_member=a.source_member or old.source_member,
                completed_at=done,
                # what the snapshot Job reports of its source (Backup status postgresVersion, timeline)
                major=source.major if source is not None and done else old.major,
                timeline=source.timeline if source is not None and done else old.timeline,
            )

    def _do_UpdateRestore(self, a: A.UpdateRestore) -> None:
        old = self.restores.get(a.name)
        if old is not None:
            self.restores[a.name] = replace(old, phase=a.phase)

    def _do_Prune(self, a: A.Prune) -> None:
        self.pruned += 1

    def _do_RecordEvent(self, a: A.RecordEvent) -> None:
        pass

    def _do_CheckUpgrade(self, a: A.CheckUpgrade) -> None:
        node = self._node(a.member)
        if node is None or not node.pod_up or node.silenced:
            return
        if node.last_action is not None and node.last_action.request_id == a.request_id:
            return
        ok = node.writable and not node.fenced and node.major < a.major and not self.check_fails
        error = None if ok else ("simulated check failure" if self.check_fails else "not a running primary")
        node.last_action = ActionEnd("upgrade-check", a.request_id, ok, error)

    def _do_UpgradeMember(self, a: A.UpgradeMember) -> None:
        """pg_upgrade --link, then the start read-write and the checks (agent/upgrading.py): only on a
        fenced primary stopped cleanly; a failure in pg_upgrade leaves the old data as it was, a failed
        check leaves the new major's data, stopped and fenced."""
        node = self._node(a.member)
        if node is None or not node.pod_up or node.silenced:
            return
        if node.last_action is not None and node.last_action.request_id == a.request_id:
            return
        ready = (
            node.fenced
            and not node.running
            and node.role is Role.PRIMARY
            and node.shutdown_clean is True
            and not node.data_lost
            and node.major < a.major
        )
        fault, self.upgrade_fails = self.upgrade_fails, None
        if not ready or fault == "pg_upgrade":
            node.last_action = ActionEnd("upgrade", a.request_id, False, "simulated pg_upgrade failure")
            return
        node.major = a.major
        node.timeline = self.next_timeline
        self.next_timeline += 1
        node.wal = [*node.wal, -node.timeline]  # the new cluster: the old data, a new history
        node.kept_aside += 1
        self.upgrades.append((node.name, a.major))
        if fault == "verify":
            node.last_action = ActionEnd("upgrade", a.request_id, False, "simulated check failure")
            return
        node.fenced = node.fence_pending = False
        node.running = True
        node.sync = ASYNC  # synchronous_standby_names is not carried over
        node.last_action = ActionEnd("upgrade", a.request_id, True)

    # ---- requests ----------------------------------------------------------------------------
    def request_backup(self) -> None:
        name = f"b{len(self.backups)}"
        self.backups[name] = BackupView(name, created_at=self.now)

    def request_restore(self) -> None:
        """A person asks for an in-place restore (once the previous one has ended: each Restore
        object is carried out in turn, and a queue of them only lengthens the run)."""
        done = [b for b in self.backups.values() if b.phase == "Completed"]
        open_ = [r for r in self.restores.values() if r.phase not in ("Completed", "Failed")]
        if not done or open_:
            return
        name = f"r{len(self.restores)}"
        self.restores[name] = RestoreView(name, backup=done[-1].name, created_at=self.now)

    def tick(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def expected_names(instances: int) -> list[str]:
    return [member_name(CLUSTER, i) for i in range(instances)]
