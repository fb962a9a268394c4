"""`pgherd instance run`: the agent's life, from boot to SIGTERM.

The main thread only waits for a signal (Python runs signal handlers there) and, as PID 1, reaps
orphans; the boot (seeding, the first start) runs in its own thread so that the probes and /status
answer from the first second.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from pgherd_backup import logformat
from pgherd_backup.agent import tls
from pgherd_backup.agent.actions import fence_if_isolated
from pgherd_backup.agent.credentials import Credentials, RedactingFilter, SecretFile
from pgherd_backup.agent.instance import Instance
from pgherd_backup.agent.options import AgentOptions
from pgherd_backup.agent.server import AgentServer
from pgherd_backup.agent.supervisor import OrphanReaper
from pgherd_backup.agent.upstream import UpstreamWatch
from pgherd_backup.agent.volumelock import hold_volume
from pgherd_backup.errors import UsageError

if TYPE_CHECKING:
    from pgherd_backup.agent.metrics import MetricsServer
    from pgherd_backup.walservice import WalService

log = logging.getLogger("pgherd.agent")


def load_credentials(options: AgentOptions) -> Credentials:
    def optional(path: Path | None, what: str) -> SecretFile | None:
        return SecretFile(path, what) if path is not None else None

    return Credentials(
        SecretFile(options.token_file, "operator token"),
        superuser_password=optional(options.superuser_password_file, "superuser password"),
        replication_password=optional(options.replication_password_file, "replication password"),
        app_password=optional(options.app_password_file, "application password"),
    )


def configure_logging(options: AgentOptions, credentials: Credentials) -> None:
    """stderr in --log-format; a JSON line names this member, its cluster and namespace."""
    logformat.configure(
        options.log_format,
        logging.INFO,
        defaults=logformat.LogContext(options.namespace, options.cluster, options.member),
        filters=[RedactingFilter(credentials)],
    )


# How often (seconds) the agent looks for renewed certificates (PostgreSQL's and its own HTTPS server's):
# a Secret's new content reaches the pod's files within the kubelet's sync period (about a minute) anyway.
CERTIFICATE_CHECK = 10


# glibc's M_MMAP_THRESHOLD (mallopt): set, it no longer rises to the size of the last large block freed.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 128 * 1024


def return_large_blocks() -> None:
    """Blocks over 128 KiB mapped and unmapped, always. The WAL service pushes 16 MiB segments in the
    agent's process (their bytes, a digest, the compressed copy): with glibc's sliding threshold every
    push after the first came from the heap and stayed, about 40 MB more RSS for the agent's life."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)  # not glibc: nothing to do


def run(options: AgentOptions) -> int:
    return_large_blocks()
    credentials = load_credentials(options)
    configure_logging(options, credentials)
    served = None
    if options.no_tls:
        log.warning(
            "!!! --no-tls: the agent's API, its bearer token included, travels in clear text. "
            "For tests and the local sandbox only; never on a network. !!!"
        )
    else:
        assert options.tls_cert is not None and options.tls_key is not None
        try:
            served = tls.ServedCertificate(options.tls_cert, options.tls_key)
        except (OSError, ValueError) as exc:
            raise UsageError(
                f"cannot load the TLS certificate {options.tls_cert} / key {options.tls_key}: {exc}"
            ) from None
    # Before the state is read or anything written: another agent of this member may still run there.
    volume_lock = hold_volume(options.volume)
    instance = Instance(options, credentials)
    instance.prepare_volume()
    try:
        context = None if served is None else served.context
        server = AgentServer(instance, options.listen, options.port, context)
    except OSError as exc:
        raise UsageError(
            f"cannot listen on {options.listen}:{options.port} ({exc.strerror}): choose another --port"
        ) from None
    metrics = _metrics_server(instance)
    wal_service = _wal_service(options, promoting=lambda: instance.action_name == "promote")
    server.start()
    if metrics is not None:
        metrics.start()
        log.info("metrics at http://%s:%d/metrics", options.listen, metrics.port)
    log.info(
        "agent of %s/%s serving %s on %s:%d (PostgreSQL port %d, data %s)",
        options.cluster,
        options.member,
        "HTTP" if options.no_tls else "HTTPS",
        options.listen,
        server.port,
        options.pg_port,
        options.pgdata,
    )

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if not stop.is_set():
            log.info("%s received", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=instance.boot, name="boot", daemon=True).start()
    watch = UpstreamWatch(instance).start()  # samples only while PostgreSQL runs as a replica
    reaper = OrphanReaper() if os.getpid() == 1 else None
    ticks = 0
    while not stop.wait(1.0):
        if reaper is not None:
            reaper.reap(keep=instance.postmaster.pid)
        ticks += 1
        try:
            fence_if_isolated(instance)
        except Exception:  # never let the check stop the agent's loop
            log.exception("the isolation check failed")
        if ticks % CERTIFICATE_CHECK == 0:
            instance.refresh_tls()
            if served is not None and (renewed := served.refresh()) is not None:
                server.context = renewed  # the next handshakes; connections open keep theirs
    instance.terminate()
    watch.stop()
    server.stop()
    if metrics is not None:
        metrics.stop()
    if wal_service is not None:
        wal_service.stop()
    log.info("agent stopped")
    if volume_lock is not None:
        os.close(volume_lock)  # its PostgreSQL stopped: the next agent may start
    return 0


def _metrics_server(instance: Instance) -> MetricsServer | None:
    """GET /metrics on --metrics-port (none with 0), on the address of the agent's own server."""
    options = instance.options
    if not options.metrics_port:
        return None
    from pgherd_backup.agent.metrics import MetricsServer, Readings

    try:
        return MetricsServer(Readings(instance), options.listen, options.metrics_port)
    except OSError as exc:
        raise UsageError(
            f"cannot listen on {options.listen}:{options.metrics_port} for the metrics ({exc.strerror}):"
            " choose another --metrics-port, or 0 to serve none"
        ) from None


def _wal_service(options: AgentOptions, promoting: Callable[[], bool]) -> WalService | None:
    """The WAL service archive_command and restore_command ask first (walservice.py); only with a store."""
    if not options.store:
        return None
    from pgherd_backup.walservice import WalService

    return WalService(
        options.open_store(),
        options.wal_socket,
        options.volume,
        failure_file=options.archive_failure_file,
        promoting=promoting,
    ).start()
