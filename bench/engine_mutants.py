"""Is the engine's property model strong enough? Revert each safety fix and let the search find it.

For every mutant below (one fix of issue #10 taken back, as a textual change of the engine), this
script copies the source tree to a scratch directory, applies the change, and runs the property search
(tests/engine/test_properties.py with the hypothesis profile ``hunt``: CI's sizes from each given
seed, stopping at the first failure without shrinking it). A mutant is *found* when the search fails; the report gives, per mutant and seed, the verdict,
the assertion that caught it and the time taken.

    .venv/bin/python bench/engine_mutants.py                       # every mutant, seeds 1 and 2
    .venv/bin/python bench/engine_mutants.py --only instant-votes --seeds 1 2 3
    .venv/bin/python bench/engine_mutants.py --only --seeds 4 5 6      # the control alone

A control row (``--control``) runs the same search on the unmutated engine first: a mutant's "found"
means something only when the control passes at that seed.

Mutants that only a scripted scenario can reach (a failover with no sync configuration known, a
stray primary on a newer timeline: see docs/engine.md) are listed with ``scripted`` and their
regression test in tests/engine/test_safety.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = "operator/pgherd/engine"


@dataclass(frozen=True)
class Mutant:
    name: str
    item: str  # the finding of issue #10 it takes back
    path: str
    old: str
    new: str
    scripted: str = ""  # the scripted test that catches it, when the search cannot reach it


MUTANTS = (
    Mutant(
        "scale-down-holders",
        "1",
        f"{ENGINE}/membership.py",
        "    return holders >= len(replicas) - majority(len(remaining)) + 1\n",
        "    return True\n",
    ),
    Mutant(
        "restore-evidence",
        "2",
        f"{ENGINE}/recovery.py",
        "    if len(lost) < ctx.needed():\n",
        "    if False:\n",
    ),
    Mutant(
        "fence-evidence",
        "4",
        f"{ENGINE}/failover.py",
        "        if not cannot_write(member):\n",
        "        if member is not None and member.exists and not member.fenced:\n",
    ),
    Mutant(
        "planned-restart",
        "5",
        f"{ENGINE}/decide.py",
        "        planned = rollout.restarting_primary(ctx)\n",
        "        planned = False\n",
    ),
    Mutant(
        "unclean-final-lsn",
        "6",
        f"{ENGINE}/switchover.py",
        "        final = old.received_lsn if clean and old is not None else None\n",
        "        final = old.received_lsn if old is not None else None\n",
    ),
    Mutant(
        "rank-by-received",
        "7",
        f"{ENGINE}/context.py",
        "    return (-(member.most_wal or 0), -(member.replayed_lsn or 0), member.name)\n",
        "    return (-(member.received_lsn or 0), -(member.replayed_lsn or 0), member.name)\n",
    ),
    Mutant(
        "vanished-target",
        "8",
        f"{ENGINE}/failover.py",
        "        return assess(replace(ctx, status=status))\n",
        "        again = Operation(OperationKind.FAILOVER, started_at=ctx.now, source=operation.target,"
        ' reason="vanished").at("fence", ctx.now)\n'
        "        return advance(replace(ctx, status=replace(status, operation=again)), again)\n",
    ),
    Mutant(
        "abort-drops-actions",
        "9",
        f"{ENGINE}/rollout.py",
        '    return Outcome(Phase.FAILED, status, actions, message=f"rolling update aborted: {why}")\n',
        '    return Outcome(Phase.FAILED, status, (), message=f"rolling update aborted: {why}")\n',
    ),
    Mutant(
        "kept-aside-deleted",
        "10",
        f"{ENGINE}/membership.py",
        "keep_data=member.kept_aside > 0,",
        "keep_data=False,",
    ),
    Mutant(
        "instant-votes",
        "12 (votes)",
        f"{ENGINE}/failover.py",
        "    votes = [name for name, when in votes_since.items() if ctx.now - when >= ctx.detection]\n",
        "    votes = list(votes_since)\n",
    ),
    Mutant(
        "no-config-keeps-commits",
        "12 (failover_keeps_commits)",
        f"{ENGINE}/quorum.py",
        "    if not configs:\n        return False\n",
        "    if not configs:\n        return True\n",
        scripted="test_failover_keeps_commits_is_false_without_any_known_configuration",
    ),
    Mutant(
        "stray-rewound",
        "12 (stray primary)",
        f"{ENGINE}/membership.py",
        "reclone=reclone or stray,",
        "reclone=reclone,",
        scripted="test_a_stray_primary_on_a_newer_timeline_is_recloned_not_rewound",
    ),
    Mutant(
        "two-members-never-fail-over",
        "12 (two members)",
        f"{ENGINE}/failover.py",
        "            return 1\n    return majority(voters)\n",
        "            return majority(voters)\n    return majority(voters)\n",
    ),
    Mutant(
        "rw-endpoint-not-repaired",
        "found by the model",
        f"{ENGINE}/membership.py",
        "    if ctx.view.rw_member != primary.name:\n",
        "    if False:\n",
    ),
)


CONTROL = Mutant("control (no mutant)", "-", f"{ENGINE}/decide.py", "", "")


def _tree(mutant: Mutant) -> Path:
    scratch = Path(tempfile.mkdtemp(prefix=f"pgherd-mutant-{mutant.name.split()[0]}-"))
    for part in ("operator", "backup", "tests", "pyproject.toml"):
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, scratch / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, scratch / part)
    if mutant is CONTROL:
        return scratch
    target = scratch / mutant.path
    text = target.read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(f"mutant {mutant.name}: the fix it reverts is not in {mutant.path} (update it)")
    target.write_text(text.replace(mutant.old, mutant.new))
    return scratch


def _failing_step(output: str) -> str:
    """The rule (or ``teardown``, the healing phase, or an invariant) during which the check failed:
    the first frame of test_properties.py in the traceback (the last frame shows only its code)."""
    frames = re.findall(r"test_properties\.py:\d+: in (\w+)", output)
    if frames:
        return frames[0]
    code = [name for name in re.findall(r"^    def (\w+)\(", output, re.MULTILINE) if name != "runTest"]
    return code[0] if code else ""


def _readable(message: str, width: int = 110) -> str:
    """An assertion message fit for a Markdown table cell: enum reprs (``<Phase.RUNNING: 'Running'>``)
    as their values, no pipe, cut at ``width`` characters (marked with an ellipsis)."""
    text = re.sub(r"<\w+\.\w+: '([^']*)'>", r"\1", message).replace("|", "/")
    return text if len(text) <= width else text[: width - 1] + "…"


def run(mutant: Mutant, seed: int, profile: str) -> tuple[str, float, str, str]:
    scratch = _tree(mutant)
    env = {**os.environ, "HYPOTHESIS_PROFILE": profile, "PYTHONPATH": f"{scratch}/operator:{scratch}/backup"}
    where = subprocess.run(
        [sys.executable, "-c", "import pgherd.engine; print(pgherd.engine.__file__)"],
        cwd=scratch, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    if not where.startswith(str(scratch)):
        shutil.rmtree(scratch, ignore_errors=True)
        raise SystemExit(f"the mutated engine is not the one imported ({where.strip()})")
    started = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/engine/test_properties.py", "-x", "-q", "-p",
             "no:cacheprovider", f"--hypothesis-seed={seed}"],
            cwd=scratch, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
    finally:
        elapsed = time.monotonic() - started
        shutil.rmtree(scratch, ignore_errors=True)
    caught = [_readable(m) for m in re.findall(r"(?:AssertionError|InvariantError): ([^\n]*)", result.stdout)]
    verdict = "found" if result.returncode == 1 else ("missed" if result.returncode == 0 else "error")
    if mutant is CONTROL:
        verdict = {"found": "FAILS", "missed": "passes"}.get(verdict, verdict)
    step = _failing_step(result.stdout) if verdict in ("found", "FAILS") else ""
    return verdict, elapsed, (caught[0] if caught else result.stdout.strip().splitlines()[-1][:110]), step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="mutant names (none: the control alone)")
    parser.add_argument("--seeds", nargs="*", type=int, default=[1, 2])
    parser.add_argument("--profile", default="hunt")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    unknown = sorted(set(args.only or ()) - {m.name for m in MUTANTS})
    if unknown:
        parser.error(f"no mutant named {', '.join(unknown)}")
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    if args.control:
        chosen.insert(0, CONTROL)
    work = [(m, seed) for m in chosen for seed in args.seeds]
    print(
        "| mutant | item | seed | search | time s | caught by | in step |\n"
        "| --- | --- | ---: | --- | ---: | --- | --- |"
    )
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run, mutant, seed, args.profile): (mutant, seed) for mutant, seed in work}
        for future in as_completed(futures):
            mutant, seed = futures[future]
            verdict, elapsed, caught, step = future.result()
            extra = f" (scripted: {mutant.scripted})" if mutant.scripted and verdict != "found" else ""
            print(
                f"| {mutant.name} | {mutant.item} | {seed} | {verdict}{extra} | {elapsed:.0f} | {caught} | {step} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
