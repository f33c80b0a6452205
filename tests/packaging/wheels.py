"""Build the repository's two wheels and fresh virtual environments, for tests/packaging.

The wheels are built as a user would build them, ``pip wheel --no-deps``, from a copy of
the files a clone has (tracked, or new and not ignored), so the checkout gets no build
litter and nothing outside a clone (``.venv``, ``_build``) can leak into a wheel.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The pinned CPU wheel (a local file on the build machines); never an open torch.
TORCH = "torch==2.13.0"


def run(*command: str, cwd: Path | None = None, env: dict | None = None) -> str:
    """Run ``command``; its stdout, or an assertion error with everything it printed."""
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def clone_copy(dest: Path) -> Path:
    """A copy of the files a clone of the checkout has, at ``dest``."""
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT)
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the work tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def build_wheel(project: Path, out: Path) -> Path:
    """``pip wheel --no-deps project``: the one wheel it writes into ``out``."""
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(project))
    (wheel,) = out.glob("*.whl")
    return wheel


def wheel_files(wheel: Path) -> list[str]:
    """The names of the files in ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        return [name for name in archive.namelist() if not name.endswith("/")]


def fresh_venv(where: Path) -> Path:
    """A new virtual environment with the pinned torch and nothing else; its python."""
    run(sys.executable, "-m", "venv", str(where))
    python = where / "bin" / "python"
    run(str(python), "-m", "pip", "install", "--quiet", TORCH)
    return python


def pinned(name: str) -> str:
    """``name==version`` as requirements.txt pins it."""
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.lower().startswith(f"{name.lower()}=="):
            return line.strip()
    raise AssertionError(f"{name} is not pinned in requirements.txt")
