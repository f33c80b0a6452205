"""The experiments' prefix tests: import a seeded script, compare a rerun with its data."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest

from gradlab_book import stored as stored_data

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load(name: str) -> ModuleType:
    """``experiments/<name>.py``, imported (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_prefix_reproduces(got, want, stored: dict, rtol: float) -> None:
    """A rerun prefix against the stored one: bit for bit on the platform that wrote
    ``stored``, within ``rtol`` (relative, elementwise) on any other.

    The tolerance is the test's claim about how far float32 kernel noise carries a run
    on another CPU; each prefix test also shows that a real change (another seed, a 1 %
    change of the learning rate) falls outside it, with :func:`assert_outside`.
    """
    if stored_data.same_platform(stored):
        assert list(got) == list(want)
    else:
        assert list(got) == pytest.approx(list(want), rel=rtol, nan_ok=True)


def assert_outside(got, want, rtol: float) -> None:
    """At least one entry of ``got`` differs from ``want`` by more than ``rtol``."""
    assert len(got) == len(want)
    assert any(
        not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > rtol * max(abs(b), 1e-30)
        for a, b in zip(got, want, strict=True)
    ), "a real change stays within the tolerance: the test could not see it"
