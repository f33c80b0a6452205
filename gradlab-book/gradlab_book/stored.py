"""The book's stored data files: where they lie, and the writer of the seeded experiments.

The scripts under ``experiments/`` write their results into this package's ``data/``
folder, which ships with it (package data), so a chapter finds them wherever it runs:
from a clone, from an installed wheel, on Colab, or opened alone in an empty folder.
Every module of the book finds a data file through :func:`path`, which asks
:mod:`importlib.resources` for the installed package's folder, never through its own
location in a source tree.
"""

from __future__ import annotations

import functools
import json
import os
import platform as _platform
import re
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["folder", "path", "platform", "same_platform", "write_json"]

#: The environment variables that change the float kernels without changing the CPU.
NUMERIC_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OPENBLAS_CORETYPE")


def folder() -> Path:
    """The folder of the stored data files, ``gradlab_book/data/`` where the package is installed.

    Returns:
        Path: a folder on disk (pip unpacks a wheel, so the package's files are files).

    Raises:
        FileNotFoundError: when the package is imported from somewhere without a folder of
            its own on disk (a zip archive).
    """
    data = files(__package__) / "data"
    if not isinstance(data, Path):
        raise FileNotFoundError(
            f"gradlab_book is imported from {files(__package__)!s}, not from a folder: "
            "install it with pip, which unpacks it"
        )
    return data


def path(name: str) -> Path:
    """The stored data file ``name`` (``"norm_traces.json"``, say), which may not exist yet.

    Args:
        name (str): a file name in :func:`folder`, without any folder part.

    Returns:
        Path: ``folder() / name``.

    Raises:
        TypeError: if ``name`` is not a string.
        ValueError: if ``name`` is empty, names a folder or reaches outside :func:`folder`.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a file name (str), got {type(name).__name__}")
    if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
        raise ValueError(f"name must be a file name without a folder part, got {name!r}")
    return folder() / name


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return _platform.processor() or _platform.machine()
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else _platform.machine()


def _blas(config: str) -> str:
    found = re.search(r"BLAS_INFO=([\w.+-]+)", config)
    return found.group(1) if found else "unknown"


@functools.cache
def platform() -> dict[str, str]:
    """What the float results of a run depend on, beside the code: the numeric platform.

    The torch and numpy versions, the CPU model, the ATen CPU capability torch's kernels
    run at (``avx2``, ``avx512``, ``default``), the BLAS of torch and of numpy, and the
    environment variables that change the kernels (:data:`NUMERIC_ENV`). The seeded
    experiments store it beside their results, and their prefix tests compare bit for bit
    where it matches and within a stated tolerance elsewhere.

    Returns:
        dict[str, str]: one string per entry.
    """
    numpy_blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"].get("name", "")
    return {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cpu": _cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "torch_blas": _blas(torch.__config__.show()),
        "numpy_blas": str(numpy_blas),
        **{name.lower(): os.environ.get(name, "") for name in NUMERIC_ENV},
    }


def same_platform(stored: dict[str, Any]) -> bool:
    """Whether ``stored`` (a data file with a ``"platform"`` entry) was made on this one."""
    return stored.get("platform") == platform()


def write_json(path: Path, data: Any) -> int:
    """Write ``data`` to ``path`` as one line of compact JSON, making its folder.

    Compact so that the committed files stay small; one trailing newline, as git likes.

    Args:
        path (Path): the file to write, usually :func:`path` of its name.
        data: anything :func:`json.dumps` takes.

    Returns:
        int: the size of the file in bytes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return path.stat().st_size
