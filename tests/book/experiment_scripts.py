"""Import a seeded script of ``experiments/`` as a module, for its prefix tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load(name: str) -> ModuleType:
    """``experiments/<name>.py``, imported (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
