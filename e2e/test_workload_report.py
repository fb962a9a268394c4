"""The write load's bookkeeping, on hand-made attempts: the scenarios' verdicts rest on it."""

from __future__ import annotations

from e2e.workload import Attempt, WriteReport


def _report(*attempts: tuple[int, float, float, str | None]) -> WriteReport:
    return WriteReport("t", [Attempt(*a) for a in attempts])


def test_lost_lists_acknowledged_ids_missing_from_the_cluster_only() -> None:
    report = _report((1, 0.0, 0.1, None), (2, 0.1, 0.2, "OperationalError"), (3, 0.2, 0.3, None))
    assert report.acked_ids() == [1, 3]
    assert report.lost({1, 3}) == []
    assert report.lost({1, 2}) == [3]  # a failed write that made it anyway is not "acknowledged"


def test_failure_windows_run_from_the_last_success_to_the_next() -> None:
    report = _report(
        (1, 0.0, 1.0, None),
        (2, 1.0, 1.5, "refused"),
        (3, 1.5, 2.0, "refused"),
        (4, 2.0, 4.0, None),
        (5, 4.0, 5.0, None),
        (6, 5.0, 6.0, "refused"),
    )
    windows = report.failure_windows()
    assert [(w.start, w.end, w.failures) for w in windows] == [(1.0, 4.0, 2), (5.0, 6.0, 1)]
    assert windows[0].seconds == 3.0 and windows[0].first_error == "refused"


def test_windows_described_at_the_wall_clock_with_their_distinct_errors() -> None:
    report = _report(
        (1, 0.0, 1.0, None),
        (2, 1.0, 1.5, "AdminShutdown: terminating connection"),
        (3, 1.5, 2.0, "OperationalError: refused\nDETAIL: more"),
        (4, 2.0, 2.5, "OperationalError: refused"),
        (5, 2.5, 4.0, None),
    )
    report.wall_offset = 1_796_485_500.0  # 2026-12-05 15:45:00 UTC at monotonic 0
    assert report.describe_windows() == (
        "  15:45:01.000 to 15:45:04.000 UTC (3.00 s, 3 failed): "
        "AdminShutdown: terminating connection | OperationalError: refused"
    )


def test_max_gap_between_acknowledgements_within_bounds() -> None:
    report = _report((1, 0.0, 1.0, None), (2, 1.0, 1.2, None), (3, 1.2, 5.2, None), (4, 5.2, 5.3, None))
    assert report.max_gap() == 4.0
    assert report.max_gap(since=5.0) == 4.0  # the gap in progress at `since` counts
    assert abs(report.max_gap(since=5.25) - 0.1) < 1e-9


def test_first_ack_after_a_kill_ignores_commits_in_flight_when_asked() -> None:
    report = _report((1, 9.9, 10.05, None), (2, 10.2, 13.0, None))
    first = report.first_ack_after(10.0)
    assert first is not None and first.id == 1
    first_begun = report.first_ack_after(10.0, begun=True)
    assert first_begun is not None and first_begun.id == 2
