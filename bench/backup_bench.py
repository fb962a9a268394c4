"""Backup benchmark: pgherd-backup against pg_basebackup to local disk and barman-cloud, measured in
the same run, on the same database and the same S3 server (rclone serve s3 on 127.0.0.1). Each figure
is the median of --repeat runs (3 by default): on a 2-core machine one run can be 20% off.

    .venv/bin/python bench/backup_bench.py                  # scale 100 + 512 MiB of random text
    .venv/bin/python bench/backup_bench.py --scale 10 --text-mb 64   # quick run while debugging

Prints wall time and peak memory (RSS summed over the process tree, sampled every 20 ms) of each
snapshot and restore, and the ratios. barman-cloud (`barman[cloud]`, which offers gzip, bzip2,
snappy and lz4 but not zstd) is installed into its own virtualenv on first use. Run by hand: this
is not a test and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pgherd.local.ports import free_port
from pgherd.local.s3server import S3Server
from pgherd_backup.postgres import config, postmaster, seed
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.process import grant_traverse
from pgherd_backup.restore import agent_executable

BARMAN_VENV = Path(os.environ.get("PGHERD_BENCH_BARMAN_VENV", Path.home() / ".cache/pgherd/barman-venv"))


def _tree_rss(root: int) -> int:
    """Resident memory of `root` and all its descendants, in bytes."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            parents[int(entry.name)] = int(fields[1])
            rss[int(entry.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return total


@dataclass
class Measure:
    label: str
    seconds: float
    peak_rss: int
    ok: bool
    detail: str = ""
    cpu_seconds: float = 0.0  # user+system CPU of the process tree (not the server nor S3)


REPEAT = 1  # set from --repeat: each figure is the median of this many runs


def measure(
    label: str,
    args: Sequence[str],
    env: dict[str, str] | None = None,
    before: Callable[[], None] | None = None,
) -> Measure:
    """Run the command REPEAT times (calling `before` ahead of each run, untimed): the median wall
    time and CPU, the highest peak memory; a failed run makes the measure failed."""
    print(f"-- {label}: {' '.join(args)[:160]}", flush=True)
    runs = []
    for _ in range(REPEAT):
        if before is not None:
            before()
        runs.append(_measure_once(label, args, env))
        if not runs[-1].ok:
            return runs[-1]
    if len(runs) == 1:
        return runs[0]
    result = Measure(
        label,
        statistics.median(r.seconds for r in runs),
        max(r.peak_rss for r in runs),
        True,
        runs[-1].detail,
        statistics.median(r.cpu_seconds for r in runs),
    )
    print(f"   median of {len(runs)}: {result.seconds:5.1f} s", flush=True)
    return result


def _measure_once(label: str, args: Sequence[str], env: dict[str, str] | None) -> Measure:
    os.sync()  # start every run with no dirty pages left by the previous one (not timed)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.Popen(list(args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    elapsed = time.monotonic() - started
    stop.set()
    sampler.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (usage.ru_utime + usage.ru_stime)
    ok = proc.returncode == 0
    if not ok:
        print(f"   FAILED ({proc.returncode}): {err.strip()[-800:]}", flush=True)
    result = Measure(label, elapsed, peak, ok, out.strip()[-2000:], cpu)
    print(f"   {elapsed:7.1f} s   CPU {cpu:6.1f} s   peak RSS {peak / 2**20:6.0f} MiB", flush=True)
    return result


def _emptied(path: Path, create: bool = False) -> Callable[[], None]:
    """A `before` step: remove what the previous run left at `path` (and make it again, empty)."""

    def empty() -> None:
        shutil.rmtree(path, ignore_errors=True)
        if create:
            path.mkdir(parents=True)

    return empty


def ensure_barman() -> Path:
    bin_dir = BARMAN_VENV / "bin"
    if not (bin_dir / "barman-cloud-backup").exists():
        print(f"installing barman[cloud] into {BARMAN_VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(BARMAN_VENV)], check=True)
        subprocess.run([str(bin_dir / "pip"), "install", "-q", "barman[cloud,lz4]"], check=True)
    return bin_dir


def populate(bins: PgBinaries, dsn: str, scale: int, text_mb: int) -> None:
    print(f"populating: pgbench scale {scale} + {text_mb} MiB of random text", flush=True)
    subprocess.run([bins.pgbench, "-i", "-s", str(scale), "-I", "dtGvp", "-q", dsn], check=True)
    rows = text_mb * 1024 * 1024 // 256
    sql = (
        "CREATE TABLE random_text AS SELECT g AS id, "
        "(SELECT string_agg(md5(random()::text || g::text || s::text), '') FROM generate_series(1, 8) s) AS body "
        f"FROM generate_series(1, {rows}) g; CHECKPOINT;"
    )
    subprocess.run([bins.psql, "-X", "-q", "-d", dsn, "-c", sql], check=True)


def dir_size(path: Path) -> int:
    """Bytes a base backup copies: the data directory without pg_wal."""
    return sum(
        f.stat().st_size
        for f in path.rglob("*")
        if f.is_file() and not f.is_symlink() and "pg_wal" not in f.relative_to(path).parts
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--workdir", default=os.environ.get("PGHERD_BENCH_DIR", "/tmp/pgherd-bench"))
    parser.add_argument("--scale", type=int, default=100)
    parser.add_argument("--text-mb", type=int, default=512)
    parser.add_argument("--skip-barman", action="store_true")
    parser.add_argument("--barman-gzip", action="store_true", help="also barman-cloud with gzip (slow)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the median is reported")
    args = parser.parse_args()
    global REPEAT
    REPEAT = max(1, args.repeat)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o755)
    grant_traverse(sys.executable, agent_executable())
    bins = PgBinaries.find()
    pgdata = work / f"db-s{args.scale}-t{args.text_mb}"
    port = free_port()
    if not (pgdata / "PG_VERSION").exists():
        shutil.rmtree(pgdata, ignore_errors=True)
        seed.initdb(
            pgdata,
            bins=bins,
            settings=config.member_settings(
                port, extra={"shared_buffers": "256MB", "max_wal_size": "4GB", "checkpoint_timeout": "30min"}
            ),
        )
        postmaster.start(pgdata, bins=bins)
        populate(bins, f"host=127.0.0.1 port={port} user=postgres dbname=postgres", args.scale, args.text_mb)
    else:
        config.update_pgherd_conf(pgdata, {"port": port})
        postmaster.start(pgdata, bins=bins)
    dsn = f"host=127.0.0.1 port={port} user=postgres dbname=postgres"
    db_bytes = dir_size(pgdata)
    print(f"database: {db_bytes / 2**30:.2f} GiB (without pg_wal) in {pgdata}", flush=True)

    s3_root = Path(tempfile.mkdtemp(prefix="s3-", dir=work))
    server = S3Server(s3_root).start()
    server.create_bucket("bench")
    env = {**os.environ, **server.env(), "PGHERD_STORE": "s3://bench/pgherd", "PGHERD_CLUSTER": "bench"}
    agent = agent_executable()
    results: list[Measure] = []
    try:
        for codec, site in (("zstd", None), ("zstd", "agent"), ("lz4", None)):
            # the default: the source server compresses (PostgreSQL >= 15); "agent": the way for older servers
            flags = ["--compression", codec] + (["--compress-on", site] if site else [])
            if site:
                codec = f"{codec}, {site}"
            snap = measure(
                f"pgherd snapshot ({codec})",
                [agent, "snapshot", "--source", dsn, *flags],
                env,
            )
            results.append(snap)
            snap_id = json.loads(snap.detail)["id"] if snap.ok else "latest"
            target = work / f"restore-pgherd-{codec.replace(', ', '-')}"
            for flags in ([], ["--no-sync"]):
                shutil.rmtree(target, ignore_errors=True)
                results.append(
                    measure(
                        f"pgherd restore ({codec}{', no fsync' if flags else ''})",
                        [
                            agent,
                            "restore",
                            "--snapshot",
                            snap_id,
                            "--pgdata",
                            str(target),
                            "--target-immediate",
                            *flags,
                        ],
                        env,
                        before=_emptied(target),
                    )
                )
            shutil.rmtree(target, ignore_errors=True)

        for codec in ("zstd", "lz4"):
            local = work / f"basebackup-{codec}"
            shutil.rmtree(local, ignore_errors=True)
            results.append(
                measure(
                    f"pg_basebackup -Ft local ({codec})",
                    [
                        bins.pg_basebackup,
                        "-d",
                        dsn,
                        "-D",
                        str(local),
                        "-Ft",
                        "-X",
                        "fetch",
                        "-c",
                        "fast",
                        # the same compression as pgherd's default: on the server, zstd with 2 workers
                        "--compress=server-zstd:level=1,workers=2"
                        if codec == "zstd"
                        else f"--compress=server-{codec}",
                    ],
                    before=_emptied(local),
                )
            )
            extracted = work / f"extract-{codec}"
            shutil.rmtree(extracted, ignore_errors=True)
            extracted.mkdir()
            archive = next(local.glob("base.tar*"))
            results.append(
                measure(
                    f"tar -x local ({codec})",
                    ["tar", f"--use-compress-program={codec} -d", "-xf", str(archive), "-C", str(extracted)],
                    before=_emptied(extracted, create=True),
                )
            )
            shutil.rmtree(extracted, ignore_errors=True)
            shutil.rmtree(local, ignore_errors=True)

        if not args.skip_barman:
            barman = ensure_barman()
            cloud = ["--cloud-provider", "aws-s3", "--endpoint-url", server.endpoint_url]
            for flag, codec in (("--lz4", "lz4"), ("--gzip", "gzip"))[: 2 if args.barman_gzip else 1]:
                url = f"s3://bench/barman-{codec}"
                backup = measure(
                    f"barman-cloud-backup ({codec})",
                    [
                        str(barman / "barman-cloud-backup"),
                        *cloud,
                        flag,
                        "-h",
                        "127.0.0.1",
                        "-p",
                        str(port),
                        "-U",
                        "postgres",
                        "-d",
                        "postgres",
                        url,
                        "bench",
                    ],
                    env,
                )
                results.append(backup)
                listing = subprocess.run(
                    [str(barman / "barman-cloud-backup-list"), *cloud, "--format", "json", url, "bench"],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                try:
                    backup_id = json.loads(listing.stdout)["backups_list"][-1]["backup_id"]
                except (ValueError, KeyError, IndexError):
                    print(f"   cannot list barman backups: {listing.stderr.strip()[-300:]}")
                    continue
                target = work / f"restore-barman-{codec}"
                shutil.rmtree(target, ignore_errors=True)
                results.append(
                    measure(
                        f"barman-cloud-restore ({codec})",
                        [str(barman / "barman-cloud-restore"), *cloud, url, "bench", backup_id, str(target)],
                        env,
                        before=_emptied(target),
                    )
                )
                shutil.rmtree(target, ignore_errors=True)
    finally:
        server.stop()
        postmaster.stop(pgdata, bins=bins)
        shutil.rmtree(s3_root, ignore_errors=True)
        server.log_file.unlink(missing_ok=True)

    report(results, db_bytes)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1, default=str))
    return 0 if all(r.ok for r in results) else 1


def report(results: list[Measure], db_bytes: int) -> None:
    by_label = {r.label: r for r in results if r.ok}
    print(f"\n{'run':36} {'seconds':>8} {'MiB/s':>8} {'peak RSS MiB':>13}")
    for r in results:
        rate = db_bytes / 2**20 / r.seconds if r.seconds else 0
        print(
            f"{r.label:36} {r.seconds:8.1f} {rate:8.0f} {r.peak_rss / 2**20:13.0f}{'' if r.ok else '  FAILED'}"
        )

    def ratio(name: str, reference: str, over: str) -> None:
        if name in by_label and reference in by_label:
            value = by_label[reference].seconds / by_label[name].seconds
            print(f"  {name} vs {reference}: {value:.2f}x {over}")

    print("\nratios (time of the reference / time of pgherd; > 1 means pgherd is faster):")
    for codec in ("zstd", "zstd, agent", "lz4"):
        for restore in (f"pgherd restore ({codec})", f"pgherd restore ({codec}, no fsync)"):
            ratio(restore, "barman-cloud-restore (lz4)", "faster (barman-cloud-restore does not fsync)")
            ratio(restore, "barman-cloud-restore (gzip)", "faster")
            ratio(restore, f"tar -x local ({codec.split(',')[0]})", "(local limit; tar does not fsync)")
        ratio(f"pgherd snapshot ({codec})", "barman-cloud-backup (lz4)", "faster")
        ratio(f"pgherd snapshot ({codec})", "barman-cloud-backup (gzip)", "faster")
        local = codec.split(",")[0]
        ratio(f"pgherd snapshot ({codec})", f"pg_basebackup -Ft local ({local})", "(local-disk limit)")
    peaks = [r.peak_rss for r in results if r.label.startswith("pgherd")]
    if peaks:
        print(f"  pgherd peak memory: {max(peaks) / 2**20:.0f} MiB (target < 200 MiB)")


if __name__ == "__main__":
    sys.exit(main())
