"""Hypothesis profiles for the engine suite.

- ci (default): 2000 random failure sequences of up to 80 steps (up to 160,000 operator steps), in
  about a minute and a half on a 2-core machine.
- long: ``HYPOTHESIS_PROFILE=long .venv/bin/pytest tests/engine`` -- 5000 sequences of up to 150 steps.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=2000,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "long",
    max_examples=5000,
    stateful_step_count=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile("dev", max_examples=50, stateful_step_count=40, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
