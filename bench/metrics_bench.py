"""What a member's metrics cost: one scrape (its time, the PostgreSQL statements its reading ran) and
the agent's CPU while Prometheus scrapes it every 15 s, against the same agent left idle.

    .venv/bin/python bench/metrics_bench.py                 # 2 minutes idle, 2 minutes scraped
    .venv/bin/python bench/metrics_bench.py --seconds 20    # quick run while debugging

A real agent (`pgherd instance run`, started as the agent tests start it: tests/agent/agent_helpers.py)
seeds a primary by initdb; nothing else talks to it (no kubelet probes, no operator). The statements
a reading runs are counted from PostgreSQL's own log (log_statement = all for pgherd_monitor alone,
during that step only); the CPU is the agent process's user + system time (/proc, all its threads)
and that of PostgreSQL's backend serving the metrics. Run by hand: it is not a test and asserts
nothing. docs/monitoring.md ("Cost") has its figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the agent tests' helpers from the repository root
    ROOT = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(ROOT / "tests" / "agent"))

from agent_helpers import MEMBERS, Agent, make_certs
from prometheus_client.parser import text_string_to_metric_families

from pgherd_backup.postgres.process import grant_traverse
from pgherd_backup.restore import agent_executable

SCRAPE_INTERVAL = 15.0  # Prometheus' usual scrape_interval
TICK = os.sysconf("SC_CLK_TCK")
# A logged statement: its text, and the lines that continue it (PostgreSQL indents them with a tab);
# "execute <name>:" once psycopg has prepared it (from its fifth run on).
STATEMENT = re.compile(r"LOG:\s+(?:statement|execute [^:]+): (.*(?:\n\t.*)*)")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def scrape(agent: Agent) -> tuple[float, str]:
    started = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=10) as answer:
        body = answer.read().decode()
    return time.perf_counter() - started, body


def sample(body: str, name: str) -> float:
    for family in text_string_to_metric_families(body):
        for item in family.samples:
            if item.name == name:
                return float(item.value)
    raise KeyError(name)


def metrics_backend(agent: Agent) -> int:
    return int(agent.value("SELECT pid FROM pg_stat_activity WHERE application_name = 'pgherd-metrics'"))


def statements_per_reading(agent: Agent, readings: int) -> tuple[float, list[str]]:
    """The statements `readings` fresh readings ran, from PostgreSQL's log: (per reading, the first's)."""
    agent.sql("ALTER ROLE pgherd_monitor SET log_statement = 'all'")
    agent.sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'pgherd-metrics'"
    )
    log = agent.volume / "data.log"
    try:
        time.sleep(1.1)
        scrape(agent)  # the reading that reconnects (its set_config of application_name is once a session)
        start = log.stat().st_size
        for _ in range(readings):
            time.sleep(1.1)
            scrape(agent)
        time.sleep(0.5)
        with log.open() as handle:
            handle.seek(start)
            text = handle.read()
    finally:
        agent.sql("ALTER ROLE pgherd_monitor RESET log_statement")
        agent.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'pgherd-metrics'"
        )
    statements = [" ".join(m.group(1).split()) for m in STATEMENT.finditer(text)]
    first = [s[:90] for s in statements[: round(len(statements) / readings)]]
    return len(statements) / readings, first


def cpu_over(agent: Agent, seconds: float, *, scraped: bool) -> tuple[float, float]:
    """CPU seconds of the agent, and of PostgreSQL's metrics backend, over `seconds` (scraped every 15 s
    or not at all)."""
    assert agent.process is not None
    backend = metrics_backend(agent)
    agent_before, backend_before = cpu_seconds(agent.process.pid), cpu_seconds(backend)
    end = time.monotonic() + seconds
    while True:
        if scraped:
            scrape(agent)
        left = end - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(SCRAPE_INTERVAL, left))
    return cpu_seconds(agent.process.pid) - agent_before, cpu_seconds(backend) - backend_before


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=120.0, help="each CPU measure (default 120)")
    parser.add_argument("--scrapes", type=int, default=60, help="fresh scrapes timed (default 60)")
    args = parser.parse_args()

    root = Path(
        tempfile.mkdtemp(prefix="pgherd-metrics-bench-", dir=os.environ.get("PGHERD_TEST_TMP", "/tmp"))
    )
    os.chmod(root, 0o755)
    grant_traverse(sys.executable, agent_executable())  # PostgreSQL's account runs pgherd-backup
    agent = Agent(MEMBERS[0], root / "member", make_certs(root / "certs"), flags=["--seed", "initdb"])
    try:
        agent.start()
        version = agent.value("SHOW server_version")
        scrape(agent)  # the first reading opens the kept session
        # one scrape: a fresh reading each time (the cached one is at most a second old)
        walls, readings, sizes = [], [], []
        assert agent.process is not None
        cpu_before, began = cpu_seconds(agent.process.pid), time.monotonic()
        for _ in range(args.scrapes):
            time.sleep(1.1)
            wall, body = scrape(agent)
            walls.append(wall)
            readings.append(sample(body, "pgherd_agent_scrape_duration_seconds"))
            sizes.append(len(body))
        fresh_cpu, fresh_elapsed = cpu_seconds(agent.process.pid) - cpu_before, time.monotonic() - began
        cached = [scrape(agent)[0] for _ in range(args.scrapes)]  # within the second: the same reading
        per_reading, statements = statements_per_reading(agent, 5)
        time.sleep(1.1)
        scrape(agent)  # a new session, without log_statement
        idle = cpu_over(agent, args.seconds, scraped=False)
        scraped = cpu_over(agent, args.seconds, scraped=True)
    finally:
        agent.cleanup()
        shutil.rmtree(root, ignore_errors=True)

    ms = 1000.0
    uname = platform.uname()
    print()
    print(
        f"metrics bench, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {uname.node} ({uname.machine},"
        f" {os.cpu_count()} CPUs, Linux {uname.release}), PostgreSQL {version}"
    )
    print()
    print(f"{'one scrape':<44} {'median':>9} {'min':>9} {'max':>9}")
    for label, values in (
        ("fresh reading: HTTP round trip", walls),
        ("fresh reading: the reading alone (agent)", readings),
        ("cached reading (same second): round trip", cached),
    ):
        print(
            f"{label:<44} {statistics.median(values) * ms:>7.2f}ms {min(values) * ms:>7.2f}ms"
            f" {max(values) * ms:>7.2f}ms"
        )
    print(f"{'exposition size':<44} {statistics.median(sizes) / 1024:>7.1f}KB")
    print(f"PostgreSQL statements per reading: {per_reading:g}")
    for text in statements:
        print(f"  {text}")
    print()
    minutes = args.seconds / 60
    print(
        f"{'over ' + format(args.seconds, 'g') + ' s':<30} {'agent CPU':>12} {'per minute':>12} {'metrics backend':>16}"
    )
    for label, (agent_cpu, backend_cpu) in (
        ("idle", idle),
        (f"scraped every {SCRAPE_INTERVAL:g} s", scraped),
    ):
        print(f"{label:<30} {agent_cpu:>11.2f}s {agent_cpu / minutes:>11.3f}s {backend_cpu:>15.2f}s")
    ratio = f"{scraped[0] / idle[0]:.2f}" if idle[0] else "n/a (no CPU tick while idle)"
    print(f"agent CPU scraped every {SCRAPE_INTERVAL:g} s / idle: {ratio}  (CPU time counts in 10 ms ticks)")
    # Finer: the CPU of the timed fresh scrapes above, less what the agent spends idle meanwhile.
    per_scrape = max(0.0, fresh_cpu - idle[0] / args.seconds * fresh_elapsed) / args.scrapes
    print(
        f"agent CPU per scrape (over the {args.scrapes} fresh scrapes): {per_scrape * ms:.1f} ms;"
        f" every {SCRAPE_INTERVAL:g} s that is {per_scrape / SCRAPE_INTERVAL * 100:.3f}% of a CPU"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
