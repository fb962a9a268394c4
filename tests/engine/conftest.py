"""Hypothesis profiles for the engine suite.

- default (CI): a few hundred random failure sequences, the whole engine suite in about a minute.
- long: ``HYPOTHESIS_PROFILE=long .venv/bin/pytest tests/engine`` -- thousands of longer sequences.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=300,
    stateful_step_count=60,
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
