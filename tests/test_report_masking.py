"""A failing test's report does not print the passwords of the DSNs its frames were given."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def test_a_failure_report_masks_the_dsn_passwords(pytester):
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makepyfile(
        """
        def connect(dsn, url):
            raise RuntimeError("refused")

        def test_it():
            connect("host=db user=app password=s3cr3t-Value dbname=app",
                    "postgresql://app:An0ther-Secret@db:5432/app")
        """
    )
    result = pytester.runpytest("--tb=long", "-p", "no:asyncio")
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert "refused" in output and "password=***" in output and "app:***@db" in output
    assert "s3cr3t-Value" not in output and "An0ther-Secret" not in output
