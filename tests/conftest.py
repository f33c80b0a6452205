"""Shared pytest configuration.

Hypothesis runs derandomized (the same examples on every run and every machine),
with no per-example deadline (the machine may be busy) and a modest number of
examples, so that the whole unit suite stays well under a minute on two cores.
Set HYPOTHESIS_PROFILE=thorough for a longer, randomized search.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "gradlab",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gradlab"))
