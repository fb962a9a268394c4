"""Names the operator, its object builders, the member pods and the tests agree on: one place.

Object names derive from the PostgresCluster's name; every object the operator creates carries
``pgherd.io/cluster: <cluster>`` and is owned by its PostgresCluster.
"""

from __future__ import annotations

GROUP = "pgherd.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
PLURAL_CLUSTERS = "postgresclusters"
PLURAL_BACKUPS = "backups"
PLURAL_RESTORES = "restores"

# Labels.
LABEL_CLUSTER = "pgherd.io/cluster"
LABEL_ROLE = (
    "pgherd.io/role"  # primary | replica, on member pods: what -ro selects (-rw: the operator's slice)
)
LABEL_COMPONENT = "app.kubernetes.io/component"  # postgres | snapshot | prune
LABEL_NAME = "app.kubernetes.io/name"  # always "pgherd"
LABEL_INSTANCE = "app.kubernetes.io/instance"  # the cluster's name
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"  # always "pgherd"
LABEL_POD_NAME = "statefulset.kubernetes.io/pod-name"  # set by the StatefulSet controller
LABEL_SERVICE_NAME = "kubernetes.io/service-name"  # on an EndpointSlice: its Service
# On an EndpointSlice: who writes it. The -rw Service has no selector: the operator writes its one slice.
LABEL_SLICE_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
SLICE_MANAGER = "operator.pgherd.io"  # as endpointslice-controller.k8s.io names itself
LABEL_BACKUP = "pgherd.io/backup"  # on a snapshot Job: the Backup it serves
LABEL_MEMBER = "pgherd.io/member"  # on a snapshot Job: the member it copies
LABEL_REVISION = "pgherd.io/revision"  # on the pod template: the engine's spec revision
ROLE_PRIMARY = "primary"
ROLE_REPLICA = "replica"
COMPONENT_POSTGRES = "postgres"
COMPONENT_SNAPSHOT = "snapshot"
COMPONENT_PRUNE = "prune"

# Annotations.
ANNOTATION_SWITCHOVER = "pgherd.io/switchover-to"  # <member> | any, on the PostgresCluster
ANNOTATION_REVISION = LABEL_REVISION
# On the PostgresCluster: the restore a member's agent took (JSON: restore, member, startedAt); see restores.py.
ANNOTATION_RESTORE = "pgherd.io/restore-job"
# On the PostgresCluster: the PVC uid each member's data was seen on (JSON); see volumes.py.
ANNOTATION_VOLUMES = "pgherd.io/volumes"
# On the agents' Secret: the value of the cluster's pgherd.io/rotate-certificates its certificates were
# last issued for (a new value on the cluster renews them).
ANNOTATION_ROTATED_FOR = "pgherd.io/rotate-certificates"

# kopf's own bookkeeping, under pgherd.io names.
FINALIZER = "pgherd.io/finalizer"
PROGRESS_PREFIX = "pgherd.io"

# Ports and paths inside a member pod.
POSTGRES_PORT = 5432
AGENT_PORT = 8008
METRICS_PORT = 9187  # the agent's Prometheus metrics (GET /metrics)
CONTAINER_POSTGRES = "postgres"
VOLUME_DATA = "pgdata"  # the volumeClaimTemplate: PVCs are <VOLUME_DATA>-<member>
DATA_MOUNT = "/var/lib/pgherd"  # the member's volume
PGDATA = f"{DATA_MOUNT}/data"  # PostgreSQL's data directory on it
SECRETS_MOUNT = "/etc/pgherd/secrets"  # <SECRETS_MOUNT>/<secret kind>/<key>
AGENT_TLS_MOUNT = "/etc/pgherd/agent"  # the agents' Secret: certificates, keys, CAs, the token's digest
# In a snapshot Job: the CA and the replication account's client certificate, never the server's key.
REPLICATION_TLS_MOUNT = "/etc/pgherd/replication"
CONFIG_MOUNT = "/etc/pgherd/config"  # parameters.conf (the ConfigMap)
PARAMETERS_FILE = "parameters.conf"
SUPERUSER = "postgres"
REPLICATION_USER = "streaming_replica"

# Secret keys.
KEY_USERNAME = "username"
KEY_PASSWORD = "password"
KEY_DBNAME = "dbname"
KEY_URI = "uri"
KEY_HOST = "host"
KEY_PORT = "port"
KEY_TOKEN = "token"  # the operator's bearer token (operator-only Secret)
KEY_TOKEN_DIGEST = "token.sha256"  # its digest: all a member needs
KEY_TLS_CERT = "tls.crt"
KEY_TLS_KEY = "tls.key"
KEY_CA_CERT = "ca.crt"
KEY_CA_KEY = "ca.key"
# The replication account's client certificate (CN streaming_replica), in the agents' Secret.
KEY_REPLICATION_CERT = "replication.crt"
KEY_REPLICATION_KEY = "replication.key"
# PostgreSQL's own TLS files in the agents' Secret: its server certificate and key, the CA members and
# clients verify it against (the agent's own unless the user brings theirs: spec.tls.serverCertSecret),
# and the CA whose client certificates it accepts (spec.tls.clientCASecret, else the cluster CA).
KEY_POSTGRES_CERT = "postgres.crt"
KEY_POSTGRES_KEY = "postgres.key"
KEY_POSTGRES_CA = "postgres-ca.crt"
KEY_CLIENT_CA = "client-ca.crt"


def statefulset(cluster: str) -> str:
    return cluster


def member(cluster: str, ordinal: int) -> str:
    return f"{cluster}-{ordinal}"


def pvc(cluster: str, member_name: str) -> str:
    """The data PVC of a member, as the StatefulSet controller names it."""
    return f"{VOLUME_DATA}-{member_name}"


def service_rw(cluster: str) -> str:
    return f"{cluster}-rw"


def rw_slice(cluster: str) -> str:
    """The -rw Service's EndpointSlice, which the operator writes (the primary's address, or none)."""
    return service_rw(cluster)


def service_ro(cluster: str) -> str:
    return f"{cluster}-ro"


def service_r(cluster: str) -> str:
    return f"{cluster}-r"


def service_headless(cluster: str) -> str:
    """Every member, ready or not (publishNotReadyAddresses): the pods' DNS names and the StatefulSet's
    serviceName."""
    return f"{cluster}-headless"


def member_host(cluster: str, member_name: str, namespace: str) -> str:
    """A member's stable DNS name (through the headless Service)."""
    return f"{member_name}.{service_headless(cluster)}.{namespace}.svc"


def secret_superuser(cluster: str) -> str:
    return f"{cluster}-superuser"


def secret_app(cluster: str) -> str:
    return f"{cluster}-app"


def secret_replication(cluster: str) -> str:
    return f"{cluster}-replication"


def secret_agent(cluster: str) -> str:
    """Mounted in member pods: the agent's server certificate and key, the CA, the token's digest."""
    return f"{cluster}-agent"


def secret_operator(cluster: str) -> str:
    """Never mounted in any pod: the operator's bearer token and the cluster CA's key."""
    return f"{cluster}-operator"


def configmap(cluster: str) -> str:
    return f"{cluster}-config"


def service_account(cluster: str) -> str:
    """The member pods' and Jobs' ServiceAccount: bound to no Role, no token mounted."""
    return f"{cluster}-postgres"


def pdb(cluster: str) -> str:
    return cluster


def network_policy(cluster: str) -> str:
    return cluster


def snapshot_job(backup: str) -> str:
    return f"{backup}-snapshot"


def prune_job(cluster: str, stamp: str) -> str:
    return f"{cluster}-prune-{stamp}"


def selector_labels(cluster: str) -> dict[str, str]:
    """What every member pod of the cluster carries (the StatefulSet's selector)."""
    return {LABEL_CLUSTER: cluster, LABEL_COMPONENT: COMPONENT_POSTGRES}


def common_labels(cluster: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: "pgherd",
        LABEL_INSTANCE: cluster,
        LABEL_MANAGED_BY: "pgherd",
        LABEL_CLUSTER: cluster,
        LABEL_COMPONENT: component,
    }
