"""The copyable examples run as they are, and the library stays torch-only.

Each script in examples/integrations/ runs in a fresh interpreter, in a scratch folder,
as a user would run it; each meets a NaN batch and must end with finite weights.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples" / "integrations"
TRAINERS = ("lightning", "accelerate", "transformers", "torchtitan")


@pytest.mark.parametrize(
    "script",
    [
        "lightning_guard.py",
        "accelerate_guard.py",
        "transformers_guard.py",
        "torchtitan_optim_block.py",
    ],
)
def test_example_runs(script, tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "weights finite: True" in done.stdout and "weights finite: False" not in done.stdout
    assert re.search(r"skipped [1-9]", done.stdout), done.stdout[-2000:]


def test_import_gradlab_imports_no_integration():
    code = (
        "import sys, gradlab, gradlab.integrations\n"
        f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {TRAINERS!r})\n"
        "loaded += [m for m in sys.modules if m.startswith('gradlab.integrations.')]\n"
        "print(loaded)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
