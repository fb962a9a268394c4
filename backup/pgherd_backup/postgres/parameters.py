"""Which PostgreSQL settings a user may set (spec.parameters), and their file between operator and agent.

One set, used by the CRD's CEL rules (pgherd.api.cluster builds them from the regexes here), by the
offline admission check (the same rules, and the model's validator), and by the agent when it reads
the parameters file: a cluster editor is not trusted with a shell in the pods (docs/security.md), so
anything that runs a command, loads code from a path, writes files elsewhere, or that pgherd owns, is
refused everywhere, whichever door it comes through.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# Settings pgherd sets itself: replication, archiving, recovery, the pod's layout, TLS.
OWNED: frozenset[str] = frozenset(
    {
        "port",
        "listen_addresses",
        "unix_socket_directories",
        "unix_socket_group",
        "unix_socket_permissions",
        "archive_mode",
        "archive_command",
        "archive_library",
        "restore_command",
        "recovery_target",
        "recovery_target_name",
        "recovery_target_time",
        "recovery_target_lsn",
        "recovery_target_xid",
        "recovery_target_inclusive",
        "recovery_target_action",
        "recovery_target_timeline",
        "recovery_min_apply_delay",
        "primary_conninfo",
        "primary_slot_name",
        "promote_trigger_file",
        "synchronous_standby_names",
        "synchronous_commit",
        "hot_standby",
        "wal_level",
        "wal_log_hints",
        "full_page_writes",
        "max_wal_senders",
        "max_replication_slots",
        "wal_keep_size",
        "cluster_name",
    }
)
# Settings whose value is a shell command PostgreSQL runs.
RUN_COMMANDS: frozenset[str] = frozenset(
    {"archive_cleanup_command", "recovery_end_command", "ssl_passphrase_command"}
)
# Settings that load code from a path, or read or write files outside the data directory.
PATHS: frozenset[str] = frozenset(
    {
        "dynamic_library_path",
        "jit_provider",
        "data_directory",
        "config_file",
        "hba_file",
        "ident_file",
        "external_pid_file",
        "log_directory",
        "log_filename",
        "stats_temp_directory",
        "krb_server_keyfile",
        "allow_system_table_mods",
    }
)
# Directives of postgresql.conf's syntax, not settings: they would pull in any file.
DIRECTIVES: frozenset[str] = frozenset({"include", "include_dir", "include_if_exists"})
REFUSED: frozenset[str] = OWNED | RUN_COMMANDS | PATHS | DIRECTIVES
# Every TLS setting (ssl, ssl_cert_file, ssl_min_protocol_version, ...) is pgherd's.
REFUSED_PREFIX = "ssl"

# Settings that name libraries to load: usable with library names only (never a path, so that only
# what the image installed in $libdir can be loaded): `shared_preload_libraries: pg_stat_statements`.
LIBRARIES: frozenset[str] = frozenset(
    {"shared_preload_libraries", "local_preload_libraries", "session_preload_libraries"}
)

# The name of a setting: PostgreSQL's, or an extension's custom one (`pg_stat_statements.max`).
NAME_REGEX = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$"
REFUSED_REGEX = "(?i)^(" + "|".join(sorted(REFUSED)) + "|ssl|ssl_.*)$"
LIBRARIES_REGEX = "(?i)^(" + "|".join(sorted(LIBRARIES)) + ")$"
# A comma-separated list of library names (optionally double-quoted), or nothing.
LIBRARY_LIST_REGEX = r'^\s*("?[A-Za-z0-9_][A-Za-z0-9_.-]*"?(\s*,\s*"?[A-Za-z0-9_][A-Za-z0-9_.-]*"?)*)?\s*$'
# Control characters (C0, DEL, C1) and Unicode's line and paragraph separators: no value may hold
# one. Written with escapes both RE2 (the API server's CEL) and Python's re read alike.
FORBIDDEN_CHARACTERS_REGEX = "[\\x00-\\x1f\\x7f-\\x9f\u2028\u2029]"

_NAME = re.compile(NAME_REGEX)
_REFUSED = re.compile(REFUSED_REGEX)
_LIBRARIES = re.compile(LIBRARIES_REGEX)
_LIBRARY_LIST = re.compile(LIBRARY_LIST_REGEX)
_FORBIDDEN = re.compile(FORBIDDEN_CHARACTERS_REGEX)


def is_refused(name: str) -> bool:
    """Whether `name` is a setting no user may set (case-insensitive, as PostgreSQL's names are)."""
    return _REFUSED.match(name) is not None


def problem(name: str, value: str) -> str | None:
    """Why `name = value` cannot be a user parameter, in words; None when it can."""
    if not _NAME.match(name) or _FORBIDDEN.search(name):
        return f"{name!r} is not a PostgreSQL setting name"
    if is_refused(name):
        return (
            f"{name}: settings owned by the operator, or that run commands, load code from a path or"
            " write files elsewhere, cannot be set"
        )
    if _FORBIDDEN.search(value):
        return f"{name}: a value cannot hold a control character or a line separator"
    if _LIBRARIES.match(name) and not _LIBRARY_LIST.match(value):
        return f"{name}: library names only (such as pg_stat_statements), never a path"
    return None


def problems(parameters: Mapping[str, str] | None) -> list[str]:
    return [p for name in sorted(parameters or {}) if (p := problem(name, str((parameters or {})[name])))]


def replication_timing(detection_seconds: int) -> dict[str, str]:
    """How fast replication notices a lost peer, from the cluster's failover.detectionSeconds: defaults
    under the user's parameters (a user who sets them slows detection down, knowingly). A replica asks a
    quiet primary for a word every wal_receiver_timeout / 2 and reports its silence (the agent's
    walReceiver.silentSeconds): a primary cut off by a partition is seen as lost within seconds, as a
    crashed one is, rather than after PostgreSQL's 60 s default; never so short that a loaded machine
    trips it (5 s at least)."""
    receiver = max(5, 2 * detection_seconds)
    return {
        "wal_receiver_timeout": f"{receiver}s",
        "wal_receiver_status_interval": "1s",
        "wal_retrieve_retry_interval": "500ms",
        "wal_sender_timeout": f"{max(10, receiver)}s",
    }


# -- the parameters file: written by the operator (ConfigMap) or the sandbox, read by the agent ----------

HEADER = (
    "# spec.parameters of the PostgresCluster (over the timing pgherd derives from spec.failover),"
    " written by pgherd: edit the PostgresCluster, not this.\n"
)
_LINE = re.compile(
    r"^\s*(?:(?P<name>[^\s=#']+)\s*=?\s*(?:'(?P<quoted>(?:[^']|'')*)'|(?P<bare>[^#\s]*))\s*)?(?:#.*)?$"
)


class ParameterError(ValueError):
    pass


def render(parameters: Mapping[str, object] | None) -> str:
    """`name = 'value'` lines, sorted, quotes doubled; every parameter checked first (ParameterError
    naming the first problem), so that nothing the agent would refuse is ever written."""
    lines = [HEADER]
    for name in sorted(parameters or {}):
        raw = (parameters or {})[name]
        value = ("on" if raw else "off") if isinstance(raw, bool) else str(raw)
        if (why := problem(name, value)) is not None:
            raise ParameterError(f"parameters: {why}")
        lines.append(f"{name} = '{value.replace(chr(39), chr(39) * 2)}'\n")
    return "".join(lines)


def parse(text: str, source: str = "parameters") -> dict[str, str]:
    """The parameters `render` wrote (and hand-written `name = value` lines with # comments). Lines
    end at "\\n" only: splitlines() would also cut at \\v, \\x85 or \\u2028 inside a value."""
    parameters: dict[str, str] = {}
    for number, raw in enumerate(text.split("\n"), 1):
        match = _LINE.match(raw.removesuffix("\r"))
        if match is None:
            raise ParameterError(f"{source}:{number}: expected `name = value`, got {raw.strip()!r}")
        name, quoted, bare = match.group("name", "quoted", "bare")
        if name is None:
            continue  # blank or comment
        value = quoted.replace("''", "'") if quoted is not None else bare.strip()
        if (why := problem(name, value)) is not None:
            raise ParameterError(f"{source}:{number}: {why}")
        parameters[name] = value
    return parameters
