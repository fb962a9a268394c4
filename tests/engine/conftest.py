"""Hypothesis profiles for the engine suite.

- ci (default): a fixed-seed search (derandomized: the same sequences on every run, so CI is
  reproducible): 2000 random failure sequences of up to 80 steps, about two minutes on 2 cores.
- search: the same sizes from a chosen seed, to look further than CI does:
  ``HYPOTHESIS_PROFILE=search .venv/bin/pytest tests/engine/test_properties.py --hypothesis-seed=7``
- ci-hunt: CI's search stopping at its first failure, unshrunk (quick to check a model change).
- hunt: the search without shrinking (bench/engine_mutants.py: does the search find each reverted
  safety fix, and how fast).
- long: ``HYPOTHESIS_PROFILE=long .venv/bin/pytest tests/engine`` -- 5000 sequences of up to 150 steps.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

_QUIET = [HealthCheck.too_slow, HealthCheck.filter_too_much]

settings.register_profile(
    "ci",
    max_examples=2000,
    stateful_step_count=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=_QUIET,
)
settings.register_profile(
    "search", max_examples=2000, stateful_step_count=80, deadline=None, suppress_health_check=_QUIET
)
settings.register_profile(  # the search, stopping at the first failure: no shrinking, no database
    "hunt",
    max_examples=2000,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=_QUIET,
    phases=[Phase.explicit, Phase.generate],
    database=None,
)
settings.register_profile(  # CI's fixed search stopping at its first failure, unshrunk (quick to check)
    "ci-hunt",
    max_examples=2000,
    stateful_step_count=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=_QUIET,
    phases=[Phase.explicit, Phase.generate],
)
settings.register_profile(
    "long", max_examples=5000, stateful_step_count=150, deadline=None, suppress_health_check=_QUIET
)
settings.register_profile("dev", max_examples=50, stateful_step_count=40, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
