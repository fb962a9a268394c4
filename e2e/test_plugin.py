"""`kubectl pgherd` on a real Kubernetes (localkube, kind): what needs running pods, the exec API and the
kubelet's logs. psql in a member's pod (a query's output, piped input, the exit status, --replica),
every member's logs interleaved, the status of a live cluster, a switchover and restarts followed with
--wait, and a report with the members' logs. Its console script runs as a person would run it, with
the driver's kubeconfig and context.

One cluster for the module, the tests in order (each leaves it Running). The same commands against an
API server without a node, and without pods: tests/plugin/test_real_api.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from e2e import manifests
from e2e.driver import NewCluster, healthy
from e2e.drivers.kube import KubeDriver

DRIVER = os.environ.get("PGHERD_E2E_DRIVER", "local")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        DRIVER not in ("localkube", "kind"),
        reason="Kubernetes only (pods, the exec API, the kubelet's logs): run with PGHERD_E2E_DRIVER=localkube",
    ),
]

NAME = "e2e-plugin"
SCRIPT = Path(sys.executable).parent / "kubectl-pgherd"


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> KubeDriver:
    driver = new_cluster(manifests.cluster(NAME, postgres_version=pg_version, instances=3, mode="quorum"))
    assert isinstance(driver, KubeDriver)
    return driver


def argv(driver: KubeDriver, *args: str) -> list[str]:
    """The console script with the driver's kubeconfig and context, in the cluster's namespace."""
    flags: list[str] = []
    kubectl = driver.kube.kubectl
    for flag in ("--kubeconfig", "--context"):
        if flag in kubectl:
            flags += [flag, kubectl[kubectl.index(flag) + 1]]
    return [str(SCRIPT), *flags, "-n", driver.namespace, *args]


def plugin(
    driver: KubeDriver, *args: str, stdin: str | None = None, timeout: float = 120, check: int | None = 0
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        argv(driver, *args),
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check is not None:
        assert result.returncode == check, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def test_status_of_a_live_cluster(cluster: KubeDriver) -> None:
    shown = plugin(cluster, "status", NAME).stdout
    assert shown.startswith(f"PostgresCluster {NAME} in namespace {cluster.namespace}: Running\n"), shown
    rows = [line.split() for line in shown.splitlines() if line.strip().startswith(f"{NAME}-")]
    assert len(rows) == 3 and all(row[2] == "yes" for row in rows), shown  # ready, with a node and a version
    assert "Operator: " in shown and "ready" in shown
    assert "expires in" in shown  # the agent Secret's certificate, read from its public part


def test_psql_runs_a_query_in_the_primarys_pod(cluster: KubeDriver) -> None:
    assert plugin(cluster, "psql", NAME, "--", "-Atc", "select 1").stdout == "1\n"
    assert plugin(cluster, "psql", NAME, "--", "-Atc", "select pg_is_in_recovery()").stdout == "f\n"
    assert (
        plugin(cluster, "psql", NAME, "--replica", "--", "-Atc", "select pg_is_in_recovery()").stdout == "t\n"
    )


def test_psql_reads_piped_input_and_exits_with_psqls_status(cluster: KubeDriver) -> None:
    piped = plugin(cluster, "psql", NAME, "--", "-At", stdin="select 40 + 2;\n")
    assert piped.stdout == "42\n"
    failed = plugin(cluster, "psql", NAME, "--", "-v", "ON_ERROR_STOP=1", "-c", "select nope", check=None)
    assert failed.returncode != 0 and 'column "nope" does not exist' in failed.stderr


def test_logs_interleave_every_member_by_time(cluster: KubeDriver) -> None:
    lines = plugin(cluster, "logs", NAME, "--since", "30m").stdout.splitlines()
    members = {line.split()[0] for line in lines if line.strip()}
    assert members == {f"{NAME}-0", f"{NAME}-1", f"{NAME}-2"}, members
    stamps = [line.split()[1] for line in lines]
    assert stamps == sorted(stamps)
    tail = plugin(cluster, "logs", NAME, "--tail", "3").stdout.splitlines()
    assert 0 < len(tail) <= 9


def test_logs_follow_prints_as_lines_come(cluster: KubeDriver) -> None:
    following = subprocess.Popen(
        argv(cluster, "logs", NAME, "-f", "--tail", "1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert following.stdout is not None
        first = following.stdout.readline()
        assert first.split()[0].startswith(f"{NAME}-")
    finally:
        following.terminate()
        following.wait(timeout=10)


def test_switchover_wait(cluster: KubeDriver) -> None:
    before = cluster.wait_for(healthy(3), 120, "a healthy cluster")
    target = sorted(m["name"] for m in before["members"] if m["name"] != before["primary"])[0]
    done = plugin(cluster, "switchover", NAME, "--to", target, "--wait", "--timeout", "120", timeout=180)
    assert f"switched over: {target} is the primary" in done.stdout


def test_rolling_restart_wait_restarts_every_member_replicas_first(cluster: KubeDriver) -> None:
    cluster.wait_for(healthy(3), 120, "a healthy cluster")
    done = plugin(cluster, "restart", NAME, "--wait", "--timeout", "900", timeout=960)
    assert "3/3 members restarted" in done.stdout and "restarted (pgherd.io/restart=" in done.stdout
    cluster.wait_for(healthy(3), 120, "a healthy cluster after the rolling restart")


def test_one_member_restart_wait(cluster: KubeDriver) -> None:
    status = cluster.wait_for(healthy(3), 120, "a healthy cluster")
    replica = sorted(m["name"] for m in status["members"] if m["name"] != status["primary"])[0]
    done = plugin(cluster, "restart", NAME, replica, "--wait", "--timeout", "300", timeout=360)
    assert f"{replica} restarted and ready" in done.stdout


def test_report_bundles_the_members_logs(cluster: KubeDriver, tmp_path: Path) -> None:
    bundle = tmp_path / "report.tar.gz"
    plugin(cluster, "report", NAME, "-o", str(bundle), timeout=300)
    with tarfile.open(bundle) as archive:
        names = {m.name.split("/", 1)[1] for m in archive.getmembers()}
    assert {f"logs/members/{NAME}-{i}.postgres.log" for i in range(3)} <= names
    assert any(name.startswith("logs/operator/") for name in names)
