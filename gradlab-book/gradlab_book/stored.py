"""The book's stored data files, as the seeded scripts under ``experiments/`` write them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_json"]


def write_json(path: Path, data: Any) -> int:
    """Write ``data`` to ``path`` as one line of compact JSON, making its folder.

    Compact so that the committed files stay small; one trailing newline, as git likes.

    Returns:
        The size of the file in bytes.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return path.stat().st_size
