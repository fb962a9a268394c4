"""PostgresCluster: the desired state of one highly available PostgreSQL cluster, and its status."""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from pgherd.api.common import (
    NAME_PATTERN,
    QUANTITY_PATTERN,
    ApiModel,
    Condition,
    RecoveryTarget,
    StatusModel,
    cel,
    rule,
)
from pgherd_backup.postgres import parameters as user_parameters
from pgherd_backup.retention import parse_duration

KIND = "PostgresCluster"
PLURAL = "postgresclusters"
SINGULAR = "postgrescluster"
SHORT_NAMES = ["pgc"]


# spec.parameters: one set of refused settings and one value check, shared with the agent (which
# refuses the same when it reads the parameters file) and the offline check.
def _cel_literal(regex: str) -> str:
    """A regex inside a single-quoted CEL string: its backslashes doubled."""
    return "'" + regex.replace("\\", "\\\\") + "'"


_REFUSED = _cel_literal(user_parameters.REFUSED_REGEX)
_LIBRARIES = _cel_literal(user_parameters.LIBRARIES_REGEX)
_LIBRARY_LIST = _cel_literal(user_parameters.LIBRARY_LIST_REGEX)
_FORBIDDEN = _cel_literal(user_parameters.FORBIDDEN_CHARACTERS_REGEX)
_SETTING_NAME = _cel_literal(user_parameters.NAME_REGEX)
# An S3 key prefix: segments of letters, digits, '.', '_' and '-' (none "." or ".."), joined by '/'.
S3_PATH_PATTERN = r"^(/?[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*/?)?$"

# Five cron fields (minute hour day-of-month month day-of-week), or a @macro.
CRON_PATTERN = (
    r"^(@(yearly|annually|monthly|weekly|daily|hourly)"
    r"|([0-9*/,?A-Za-z-]+\s+){4}[0-9*/,?A-Za-z-]+)$"
)
# A retention window: a number and a unit (minutes, hours, days, weeks), e.g. 7d, 36h, 2w.
DURATION_PATTERN = r"^[1-9][0-9]*(m|h|d|w)$"
# upgrade.keepOldMajorFor: an hour covers the checks an application team makes after an upgrade; a
# rollback later than that would throw away more writes than it saves (they are on the new major only).
KEEP_OLD_MAJOR_FOR = "1h"
# backup.jobStartTimeoutSeconds: a snapshot Job's pod that has not started after this long (not
# scheduled, image not pulled, a Secret missing) fails its Backup. Five minutes cover a cold pull of
# the image and a node autoscaler adding a node; a mistake (a missing Secret) is reported in minutes,
# not at the Job's own deadline, SNAPSHOT_DEADLINE_SECONDS (a snapshot may stream for hours).
JOB_START_TIMEOUT_SECONDS = 300
SNAPSHOT_DEADLINE_SECONDS = 6 * 3600
S3_BUCKET_PATTERN = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
# spec.instances at most: the members' certificate names each of them in advance.
MAX_INSTANCES = 15


class ReplicationMode(StrEnum):
    QUORUM = "quorum"
    ASYNC = "async"


class PrimaryUpdateMethod(StrEnum):
    SWITCHOVER = "switchover"
    RESTART = "restart"


class Compression(StrEnum):
    ZSTD = "zstd"
    LZ4 = "lz4"
    GZIP = "gzip"
    NONE = "none"


class OnQuorumLoss(StrEnum):
    WAIT = "Wait"
    RESTORE_FROM_BACKUP = "RestoreFromBackup"


class Phase(StrEnum):
    PENDING = "Pending"
    CREATING = "Creating"
    RUNNING = "Running"
    DEGRADED = "Degraded"
    SCALING = "Scaling"
    UPGRADING = "Upgrading"
    SWITCHING_OVER = "SwitchingOver"
    FAILING_OVER = "FailingOver"
    QUORUM_LOST = "QuorumLost"
    RECOVERING = "Recovering"
    RESTORING = "Restoring"
    PAUSED = "Paused"
    FAILED = "Failed"
    DELETING = "Deleting"


class VolumeDeletePolicy(StrEnum):
    RETAIN = "Retain"
    DELETE = "Delete"


class Storage(ApiModel):
    size: str = Field(
        default="1Gi",
        pattern=QUANTITY_PATTERN,
        description="Size of each member's data volume, a Kubernetes quantity such as 10Gi.",
    )
    storage_class_name: str | None = Field(
        default=None, description="StorageClass of the data volumes; the cluster default when unset."
    )
    delete_policy: VolumeDeletePolicy = Field(
        default=VolumeDeletePolicy.RETAIN,
        description=(
            "What deleting the PostgresCluster does to its data volumes (PVCs): Retain keeps them (a"
            " cluster created again under the same name finds its data); Delete deletes them with the"
            " cluster, and their data is lost. Backups in the store are never deleted either way."
        ),
    )


class Resources(ApiModel):
    """CPU and memory of each PostgreSQL container (core/v1 ResourceRequirements, without claims)."""

    requests: dict[str, str] | None = Field(
        default=None,
        description="Minimum resources, e.g. {cpu: 500m, memory: 1Gi}.",
        json_schema_extra={"additionalProperties": {"type": "string", "pattern": QUANTITY_PATTERN}},
    )
    limits: dict[str, str] | None = Field(
        default=None,
        description="Maximum resources, e.g. {memory: 2Gi}.",
        json_schema_extra={"additionalProperties": {"type": "string", "pattern": QUANTITY_PATTERN}},
    )


class Replication(ApiModel):
    mode: ReplicationMode | None = Field(
        default=None,
        description=(
            "quorum: a commit is acknowledged once a majority of members, primary included, has it"
            " (the default with 3 or more instances); async: the primary acknowledges alone."
        ),
    )


class Failover(ApiModel):
    enabled: bool = Field(default=True, description="Promote a replica automatically when the primary fails.")
    detection_seconds: int = Field(
        default=5,
        ge=1,
        le=300,
        description=(
            "How long the primary must be unreachable, and a majority of members agree,"
            " before it is declared failed."
        ),
    )


class Upgrade(ApiModel):
    primary_update_method: PrimaryUpdateMethod = Field(
        default=PrimaryUpdateMethod.SWITCHOVER,
        description=(
            "How the primary is updated last in a rolling update: switchover to an updated replica"
            " (default) or restart in place."
        ),
    )
    keep_old_major_for: str = Field(
        default=KEEP_OLD_MAJOR_FOR,
        pattern=DURATION_PATTERN,
        description=(
            "After a major upgrade (postgresVersion raised), how long one replica stays fenced on the old"
            " major, untouched, as the way back (annotation pgherd.io/rollback-upgrade) before the upgrade"
            " counts as confirmed and it is rebuilt on the new major; the annotation"
            " pgherd.io/confirm-upgrade confirms sooner. E.g. 1h (the default), 30m, 2d."
        ),
    )
    backup_max_age: str | None = Field(
        default=None,
        pattern=DURATION_PATTERN,
        description=(
            "A major upgrade first needs a Completed Backup of the cluster: one younger than this (e.g."
            " 6h) will do; unset (the default), one is taken when the upgrade starts."
        ),
    )


# A ConfigMap key (a file name in the mounted directory); no leading dot (the kubelet's own ..data).
CONFIG_MAP_KEY_PATTERN = r"^[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"


class CustomQueries(ApiModel):
    config_map_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=NAME_PATTERN,
        description=(
            "ConfigMap in the cluster's namespace holding the queries (docs/monitoring.md). Optional at"
            " runtime: while it is missing the members run and report pgherd_custom_queries_refused 1."
        ),
    )
    key: str = Field(
        default="queries.yaml",
        max_length=253,
        pattern=CONFIG_MAP_KEY_PATTERN,
        description="Its key: a YAML list of {name, query, help, metrics}. Default queries.yaml.",
    )


class Monitoring(ApiModel):
    custom_queries: CustomQueries | None = Field(
        default=None,
        description=(
            "Metric queries of your own, run read-only as pgherd_monitor by every member and exported as"
            " pgherd_custom_<name>_<column> on its metrics port (9187). Edits of the ConfigMap are read"
            " within about a minute; another ConfigMap or key takes effect as each member restarts."
        ),
    )


class S3Credentials(ApiModel):
    secret_name: str = Field(
        min_length=1, pattern=NAME_PATTERN, description="Secret in the cluster's namespace holding the keys."
    )
    access_key_id_key: str = Field(default="AWS_ACCESS_KEY_ID", min_length=1)
    secret_access_key_key: str = Field(default="AWS_SECRET_ACCESS_KEY", min_length=1)


SECRET_KEY_PATTERN = CONFIG_MAP_KEY_PATTERN  # a Secret's key, mounted as a file: the same rule
ENDPOINT_CA_KEY = "ca.crt"


class EndpointCA(ApiModel):
    secret_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=NAME_PATTERN,
        description="Secret in the cluster's namespace holding the CA certificate(s), PEM.",
    )
    key: str = Field(
        default=ENDPOINT_CA_KEY,
        max_length=253,
        pattern=SECRET_KEY_PATTERN,
        description="Its key: one or more PEM certificates. Default ca.crt (cert-manager's).",
    )


class S3Store(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            rule(
                "!has(self.endpointCA) || (has(self.endpoint) && self.endpoint.startsWith('https://'))",
                "endpointCA verifies the certificate of an https endpoint: set endpoint to the https:// URL"
                " of the S3 server that CA signed",
                ".endpointCA",
            )
        )
    )

    bucket: str = Field(pattern=S3_BUCKET_PATTERN, description="Bucket name (must exist).")
    path: str = Field(
        default="",
        max_length=512,
        pattern=S3_PATH_PATTERN,
        description=(
            "Prefix inside the bucket; snapshots go under <path>/<cluster>/. Letters, digits, '.', '_'"
            " and '-' in segments joined by '/'."
        ),
    )
    endpoint: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s/]+(/.*)?$",
        description="S3 endpoint URL for MinIO, Ceph, R2...; AWS when unset.",
    )
    region: str = Field(default="us-east-1", min_length=1)
    force_path_style: bool = Field(default=False, description="Address the bucket in the path (MinIO).")
    credentials: S3Credentials = Field(description="Where the access keys are: always a Secret.")
    endpoint_ca: EndpointCA | None = Field(
        default=None,
        alias="endpointCA",
        description=(
            "The CA that signed the https endpoint's certificate (MinIO or Ceph with their own CA): every"
            " S3 client of pgherd (WAL archiving and fetching, snapshot, prune and restore) verifies the"
            " endpoint against these certificates only, instead of the system's. Unset: the system's CAs."
            " A missing Secret or key fails archiving and backups with a message naming it."
        ),
    )


class BackupStore(ApiModel):
    s3: S3Store


class Retention(ApiModel):
    keep_last: int | None = Field(default=None, ge=1, description="Keep at least this many snapshots.")
    keep_within: str | None = Field(
        default=None,
        pattern=DURATION_PATTERN,
        description="Keep every snapshot younger than this (e.g. 7d, 36h, 2w).",
    )


class BackupSpec(ApiModel):
    store: BackupStore | None = None
    wal_archiving: bool | None = Field(
        default=None,
        description="Archive WAL to the store for point-in-time recovery; true by default when a store is set.",
    )
    schedule: str | None = Field(
        default=None,
        pattern=CRON_PATTERN,
        description="When to take scheduled snapshots, 5-field cron (UTC), e.g. '0 3 * * *'.",
    )
    retention: Retention | None = None
    compression: Compression = Field(default=Compression.ZSTD)
    job_start_timeout_seconds: int = Field(
        default=JOB_START_TIMEOUT_SECONDS,
        ge=1,
        le=SNAPSHOT_DEADLINE_SECONDS,
        description=(
            "How long a snapshot Job's pod may wait to start (not scheduled, its image not pulled, a"
            " Secret or key it needs missing) before its Backup is Failed with the reason the scheduler"
            " or the kubelet gives, and the Job deleted. Default 300 (5 minutes)."
        ),
    )

    @property
    def archiving_enabled(self) -> bool:
        if self.store is None:
            return False
        return True if self.wal_archiving is None else self.wal_archiving


class InitdbBootstrap(ApiModel):
    database: str = Field(default="app", min_length=1, max_length=63, pattern=r"^[a-z_][a-z0-9_]*$")
    owner: str = Field(default="app", min_length=1, max_length=63, pattern=r"^[a-z_][a-z0-9_]*$")


class FromBackupBootstrap(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            rule(
                "has(self.backup) != has(self.snapshotId)",
                "bootstrap.fromBackup: set exactly one of backup, snapshotId",
            )
        )
    )

    backup: str | None = Field(
        default=None, pattern=NAME_PATTERN, description="A Backup object to start from."
    )
    snapshot_id: str | None = Field(default=None, min_length=1, description="A snapshot id in the store.")
    cluster: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="The cluster whose archive holds the snapshot; this cluster's name when unset.",
    )
    store: BackupStore | None = Field(
        default=None, description="Where the snapshot is; spec.backup.store when unset."
    )
    target: RecoveryTarget | None = None


class Bootstrap(ApiModel):
    model_config = ConfigDict(
        json_schema_extra=cel(
            rule(
                "has(self.initdb) != has(self.fromBackup)",
                "bootstrap: set exactly one of initdb, fromBackup",
            )
        )
    )

    initdb: InitdbBootstrap | None = None
    from_backup: FromBackupBootstrap | None = None


class Recovery(ApiModel):
    on_quorum_loss: OnQuorumLoss = Field(
        default=OnQuorumLoss.WAIT,
        description=(
            "When a majority of members is lost: Wait (report QuorumLost, promote nothing) or"
            " RestoreFromBackup (fence the survivors, restore from recovery.backup, rebuild)."
        ),
    )
    backup: str = Field(
        default="latest",
        pattern=r"^(latest|[a-z0-9]([-a-z0-9]*[a-z0-9])?)$",
        description="The snapshot to recover from: latest, or the name of a Backup object.",
    )


# spec.networkPolicy.clients: NetworkPolicyPeer of networking.k8s.io/v1, as the NetworkPolicy takes it.
class LabelSelectorRequirement(ApiModel):
    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] | None = Field(default=None, max_length=64)


class LabelSelector(ApiModel):
    """metav1.LabelSelector: every label and expression must match; an empty selector matches all."""

    match_labels: dict[str, str] | None = Field(default=None, json_schema_extra={"maxProperties": 64})
    match_expressions: list[LabelSelectorRequirement] | None = Field(default=None, max_length=16)


class IPBlock(ApiModel):
    cidr: str = Field(min_length=1, max_length=43, description="Addresses allowed, e.g. 10.0.0.0/8.")
    except_: list[str] | None = Field(
        default=None, alias="except", max_length=64, description="Addresses of the CIDR refused."
    )


class NetworkPolicyPeer(ApiModel):
    """Pods (podSelector; of namespaceSelector's namespaces, else this one), namespaces, or an ipBlock."""

    model_config = ConfigDict(
        json_schema_extra=cel(
            rule(
                "has(self.ipBlock) ? !has(self.podSelector) && !has(self.namespaceSelector)"
                " : has(self.podSelector) || has(self.namespaceSelector)",
                "networkPolicy.clients: each client is an ipBlock alone, or a podSelector and/or a"
                " namespaceSelector",
            )
        )
    )

    pod_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    ip_block: IPBlock | None = None


class NetworkPolicy(ApiModel):
    enabled: bool = Field(
        default=True,
        description=(
            "A NetworkPolicy for the members: the agent's port (8008) from the operator's pods only,"
            " PostgreSQL (5432) from the members, the cluster's Jobs and `clients`, metrics (9187) from"
            " anywhere. false: no policy."
        ),
    )
    clients: list[NetworkPolicyPeer] | None = Field(
        default=None,
        max_length=32,
        description=(
            "Who else may reach PostgreSQL (5432): unset, anyone (every pod of every namespace and"
            " addresses outside the cluster); a list, only those (NetworkPolicyPeer); [], nobody else."
        ),
    )


# spec.tls.certificateLifetime: minutes (5 at least: a renewal at two thirds leaves the kubelet over 3
# minutes to bring it to the pods), hours, days or weeks. At most 825 days, the longest validity clients
# commonly accept for a server certificate.
CERTIFICATE_LIFETIME_PATTERN = r"^(([5-9]|[1-9][0-9]{1,5})m|[1-9][0-9]{0,5}(h|d|w))$"
CERTIFICATE_LIFETIME = "90d"
CERTIFICATE_LIFETIME_MAX = timedelta(days=825)


class TlsVersion(StrEnum):
    TLS_1_2 = "TLSv1.2"
    TLS_1_3 = "TLSv1.3"


class Tls(ApiModel):
    certificate_lifetime: str = Field(
        default=CERTIFICATE_LIFETIME,
        pattern=CERTIFICATE_LIFETIME_PATTERN,
        description=(
            "How long each certificate pgherd issues (the members' server certificate, the replication"
            " client certificate, the agents') is valid: e.g. 90d (the default), 2160h, 12w; 5m at least"
            " (minutes are for watching renewals in a test), 825d at most. Renewed when two thirds of it"
            " have passed; the members reload it without a restart."
        ),
    )
    min_protocol_version: TlsVersion = Field(
        default=TlsVersion.TLS_1_3,
        description=(
            "The oldest TLS version PostgreSQL accepts (ssl_min_protocol_version): TLSv1.3 (the default)"
            " or TLSv1.2. A change restarts the members one by one (replicas first, the primary last)."
        ),
    )
    server_cert_secret: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=NAME_PATTERN,
        description=(
            "A Secret of yours in the cluster's namespace, in cert-manager's shape (tls.crt, tls.key,"
            " ca.crt): PostgreSQL's server certificate on every member instead of the one pgherd issues."
            " It must name the -rw, -ro and -r Services and the members under the headless Service"
            " (docs/security.md); the app Secret's ca.crt becomes its ca.crt. Read again as it changes"
            " (a renewal reaches the members without a restart); a Secret that is missing or fails a"
            " check is reported by the condition CertificatesValid and never installed."
        ),
    )
    client_ca_secret: str | None = Field(
        default=None,
        alias="clientCASecret",
        min_length=1,
        max_length=253,
        pattern=NAME_PATTERN,
        description=(
            "A Secret of yours in the cluster's namespace holding a CA (tls.crt, tls.key; ca.crt: its"
            " root, unless it is one: what cert-manager writes for a Certificate with isCA: true):"
            " PostgreSQL accepts client certificates it signed, and pgherd signs the replication"
            " account's certificate with it instead of the cluster CA."
        ),
    )

    @field_validator("certificate_lifetime")
    @classmethod
    def _lifetime_in_bounds(cls, value: str) -> str:
        if parse_duration(value) > CERTIFICATE_LIFETIME_MAX:
            raise ValueError("certificateLifetime: 825d at most")
        return value

    @property
    def lifetime(self) -> timedelta:
        return parse_duration(self.certificate_lifetime)


_SPEC_RULES = cel(
    rule(
        "!has(self.postgresVersion) || !has(oldSelf.postgresVersion)"
        " || self.postgresVersion >= oldSelf.postgresVersion",
        "postgresVersion may only go up: a major upgrade (pg_upgrade) has no way down once confirmed;"
        " to run an older major, restore a Backup of it into a new cluster",
        ".postgresVersion",
    ),
    rule(
        "!has(self.postgresVersion) || !has(oldSelf.postgresVersion)"
        " || self.postgresVersion == oldSelf.postgresVersion || (self.instances == oldSelf.instances"
        " && has(self.image) == has(oldSelf.image) && (!has(self.image) || self.image == oldSelf.image)"
        " && has(self.parameters) == has(oldSelf.parameters)"
        " && (!has(self.parameters) || self.parameters == oldSelf.parameters)"
        " && has(self.resources) == has(oldSelf.resources)"
        " && (!has(self.resources) || self.resources == oldSelf.resources))",
        "postgresVersion changes alone: a major upgrade cannot be combined with a change of image,"
        " instances, parameters or resources in the same edit (apply those before or after it)",
        ".postgresVersion",
    ),
    rule(
        "!has(self.parameters) || self.parameters.all(k, k.matches(" + _SETTING_NAME + "))",
        "parameters: a setting name is letters, digits and '_' (an extension's: prefix.name)",
        ".parameters",
    ),
    rule(
        "!has(self.parameters) || !self.parameters.exists(k, k.matches(" + _REFUSED + "))",
        "parameters: settings owned by the operator, or that run commands, load code from a path or"
        " write files elsewhere, cannot be set (port, archive_command, restore_command, primary_conninfo,"
        " synchronous_standby_names, wal_level, max_wal_senders, archive_cleanup_command,"
        " recovery_end_command, dynamic_library_path, jit_provider, log_directory, log_filename, include,"
        " include_dir, ssl*, ...: docs/security.md lists them)",
        ".parameters",
    ),
    rule(
        "!has(self.parameters) || !self.parameters.exists(k, self.parameters[k].matches(" + _FORBIDDEN + "))",
        "parameters: a value cannot hold a control character or a line separator",
        ".parameters",
    ),
    rule(
        "!has(self.parameters) || self.parameters.all(k, !k.matches(" + _LIBRARIES + ")"
        " || self.parameters[k].matches(" + _LIBRARY_LIST + "))",
        "parameters: library names only (such as pg_stat_statements), never a path, in"
        " shared_preload_libraries, local_preload_libraries and session_preload_libraries",
        ".parameters",
    ),
    rule(
        "has(self.bootstrap) == has(oldSelf.bootstrap) && (!has(self.bootstrap) || self.bootstrap == oldSelf.bootstrap)",
        "bootstrap is immutable after creation",
        ".bootstrap",
    ),
    rule(
        "!has(self.bootstrap) || !has(self.bootstrap.fromBackup) || has(self.bootstrap.fromBackup.backup)"
        " || has(self.bootstrap.fromBackup.store) || (has(self.backup) && has(self.backup.store))",
        "bootstrap.fromBackup.snapshotId needs a store: set bootstrap.fromBackup.store or backup.store",
        ".bootstrap.fromBackup",
    ),
    rule(
        "!has(self.recovery) || self.recovery.onQuorumLoss != 'RestoreFromBackup'"
        " || (has(self.backup) && has(self.backup.store))",
        "recovery.onQuorumLoss: RestoreFromBackup needs backup.store",
        ".recovery.onQuorumLoss",
    ),
    rule(
        "!has(self.backup) || !has(self.backup.schedule) || has(self.backup.store)",
        "backup.schedule needs backup.store",
        ".backup.schedule",
    ),
    rule(
        "!has(self.backup) || !has(self.backup.walArchiving) || !self.backup.walArchiving"
        " || has(self.backup.store)",
        "backup.walArchiving needs backup.store",
        ".backup.walArchiving",
    ),
    rule(
        "!has(self.replication) || !has(self.replication.mode) || self.replication.mode != 'quorum'"
        " || self.instances != 2",
        "replication.mode: quorum with 2 instances would stop all writes when either member is down;"
        " use 1, 3 or more instances, or async",
        ".replication.mode",
    ),
)


class PostgresClusterSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=_SPEC_RULES)

    instances: int = Field(default=3, ge=1, le=MAX_INSTANCES, description="Number of members (1..15).")
    postgres_version: int = Field(
        default=16,
        ge=13,
        le=18,
        description=(
            "PostgreSQL major version, e.g. 16. Raising it upgrades the cluster in place (pg_upgrade"
            " --link, docs/upgrades.md): only upward, and alone in its edit. With image set, the image"
            " must carry this major's programs (and the old major's, for an upgrade)."
        ),
    )
    image: str | None = Field(
        default=None,
        min_length=1,
        description="Container image; the pgherd image for postgresVersion when unset.",
    )
    storage: Storage = Field(default_factory=Storage)
    resources: Resources | None = None
    parameters: dict[str, str] | None = Field(
        default=None,
        description="postgresql.conf settings (values are strings), e.g. {max_connections: '200'}.",
        json_schema_extra={"additionalProperties": {"type": "string"}},
    )
    replication: Replication = Field(default_factory=Replication)
    failover: Failover = Field(default_factory=Failover)
    upgrade: Upgrade = Field(default_factory=Upgrade)
    monitoring: Monitoring = Field(default_factory=Monitoring)
    bootstrap: Bootstrap | None = Field(
        default=None, description="How the first member's data is made; initdb when unset. Immutable."
    )
    backup: BackupSpec | None = None
    recovery: Recovery = Field(default_factory=Recovery)
    network_policy: NetworkPolicy = Field(default_factory=NetworkPolicy)
    tls: Tls = Field(
        default_factory=Tls,
        description=(
            "PostgreSQL's TLS (always on): the lifetime of the certificates pgherd issues, the oldest"
            " protocol version accepted, and your own certificates (in cert-manager's Secret shape)."
        ),
    )
    superuser_network_access: bool = Field(
        default=False,
        description=(
            "Whether the superuser may log in over the network (TLS and its password). false (the"
            " default): only on the members' Unix sockets, for pgherd's own tools. A change restarts the"
            " members one by one (replicas first, the primary last)."
        ),
    )
    paused: bool = Field(default=False, description="Observe and report only; take no action.")

    @field_validator("parameters")
    @classmethod
    def _refuse_unsafe_parameters(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # The CRD refuses these at admission; the operator checks again for objects stored before a rule
        # existed, so that an owned setting can never reach postgresql.conf.
        problems = user_parameters.problems(value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @property
    def replication_mode(self) -> ReplicationMode:
        """The effective mode: quorum by default from 3 instances up."""
        if self.replication.mode is not None:
            return self.replication.mode
        return ReplicationMode.QUORUM if self.instances >= 3 else ReplicationMode.ASYNC

    @property
    def effective_bootstrap(self) -> Bootstrap:
        return self.bootstrap if self.bootstrap is not None else Bootstrap(initdb=InitdbBootstrap())


class Member(StatusModel):
    name: str
    role: Literal["primary", "replica", "unknown", "fenced"] = "unknown"
    ready: bool = False
    reachable: bool = False
    timeline: int | None = None
    version: str | None = Field(
        default=None,
        description=(
            "The PostgreSQL server version the member runs, MAJOR.MINOR from its server_version_num"
            " (e.g. 16.15); null while its PostgreSQL does not answer."
        ),
    )
    received_lsn: str | None = Field(default=None, alias="receivedLSN")
    replayed_lsn: str | None = Field(default=None, alias="replayedLSN")
    lag_bytes: int | None = None


class CertificateStatus(StatusModel):
    name: str = Field(
        description=(
            "server (the members'), replication (the replication account's client), and with your own"
            " certificates postgres (PostgreSQL's server certificate) and clientCA."
        )
    )
    secret: str = Field(description="The Secret holding it.")
    not_after: str | None = Field(default=None, description="When it expires (UTC).")
    renew_at: str | None = Field(
        default=None,
        description="When pgherd issues it again (UTC); none for yours (their issuer renews them).",
    )


class PostgresClusterStatus(StatusModel):
    phase: Phase = Phase.PENDING
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    current_primary: str | None = None
    target_primary: str | None = None
    instances: int | None = None
    ready_instances: int | None = None
    selector: str | None = Field(
        default=None, description="Label selector of the members (scale subresource)."
    )
    members: list[Member] = Field(default_factory=list)
    timeline: int | None = None
    image: str | None = None
    postgres_version: int | None = Field(
        default=None,
        description=(
            "The PostgreSQL major the cluster's data is on (its primary's): below spec.postgresVersion"
            " while an upgrade is in progress, or after one was refused or rolled back (see the"
            " PostgresVersionReached condition)."
        ),
    )
    system_identifier: str | None = None
    operation: dict[str, Any] | None = Field(
        default=None,
        description="The multi-step operation in progress: its kind, plan and the steps done.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    engine: dict[str, Any] | None = Field(
        default=None,
        description=(
            "The engine's memory between two decisions (quorum members, synchronous standby steps,"
            " failure clocks, the last aborted operation), written before any action; a restarted"
            " operator resumes from it. Owned by the operator."
        ),
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    certificates: list[CertificateStatus] = Field(
        default_factory=list,
        description=(
            "The certificates the members use (pgherd's, and yours from spec.tls): when each expires and"
            " is renewed."
        ),
    )
    last_successful_backup: str | None = None
    first_recoverability_point: str | None = None
    message: str | None = None


class PostgresCluster(ApiModel):
    api_version: Literal["pgherd.io/v1alpha1"] = "pgherd.io/v1alpha1"
    kind: Literal["PostgresCluster"] = "PostgresCluster"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: PostgresClusterSpec = Field(default_factory=PostgresClusterSpec)
    status: PostgresClusterStatus | None = None
