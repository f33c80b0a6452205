"""The stored data files: found in the installed package, and written by one writer.

The chapters and the seeded scripts under experiments/ reach every data file through
:mod:`gradlab_book.stored`, which asks :mod:`importlib.resources` where the package lies;
no module finds data through its own place in a source tree.
"""

from __future__ import annotations

import json
import re
from importlib.resources import files
from pathlib import Path

import pytest

from gradlab_book import stored
from gradlab_book.figures import (
    adaptive,
    costs,
    privacy,
    rnn,
    skipping,
    spikes,
    thresholds,
    training,
)

ROOT = Path(__file__).resolve().parents[2]
#: Every path constant of the book's modules that names a stored file.
PATHS = {
    "adaptive.DATA_PATH": adaptive.DATA_PATH,
    "adaptive.PREFIX_PATH": adaptive.PREFIX_PATH,
    "rnn.DATA_PATH": rnn.DATA_PATH,
    "training.GRID_PATH": training.GRID_PATH,
    "privacy.COSTS_PATH": privacy.COSTS_PATH,
    "spikes.RUNS_PATH": spikes.RUNS_PATH,
    "spikes.TABLE_PATH": spikes.TABLE_PATH,
    "spikes.COSTS_PATH": spikes.COSTS_PATH,
    "spikes.PREFIX_PATH": spikes.PREFIX_PATH,
    "spikes.RECIPE_PATH": spikes.RECIPE_PATH,
    "thresholds.SWEEP_PATH": thresholds.SWEEP_PATH,
    "skipping.BENCH_PATH": skipping.BENCH_PATH,
    "costs.BENCH_CLIP": stored.path(costs.BENCH_CLIP),
    "costs.BENCH_FLAT": stored.path(costs.BENCH_FLAT),
}


def test_the_folder_is_the_packages_data_folder():
    assert stored.folder() == Path(str(files("gradlab_book"))) / "data"
    assert stored.folder().is_dir()


@pytest.mark.parametrize("name", sorted(PATHS))
def test_every_stored_path_lies_in_the_folder_and_exists(name):
    path = PATHS[name]
    assert path.parent == stored.folder() and path.is_file(), path


def test_every_file_of_the_folder_is_named_by_a_module():
    """A data file no module names is dead weight in the wheel (the runs file names the
    files that hold the rest of its runs)."""
    more = json.loads(spikes.RUNS_PATH.read_text()).get("more_files", [])
    named = {p.name for p in PATHS.values()} | set(more)
    assert {p.name for p in stored.folder().iterdir()} == named


@pytest.mark.parametrize(
    "bad, error",
    [
        ("", ValueError),
        (".", ValueError),
        ("..", ValueError),
        ("../pyproject.toml", ValueError),
        ("sub/norm_traces.json", ValueError),
        ("/etc/passwd", ValueError),
        ("a\\b.json", ValueError),
        (Path("norm_traces.json"), TypeError),
        (None, TypeError),
    ],
)
def test_path_takes_a_plain_file_name(bad, error):
    with pytest.raises(error, match="name"):
        stored.path(bad)


def test_path_of_a_file_not_written_yet_is_in_the_folder():
    assert stored.path("new_experiment.json") == stored.folder() / "new_experiment.json"


def test_no_module_finds_data_through_its_own_location():
    """``Path(__file__).parents[...]`` points into site-packages once the wheel is installed."""
    sources = [
        *(ROOT / "gradlab-book" / "gradlab_book").rglob("*.py"),
        *(ROOT / "experiments").glob("*.py"),
    ]
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in sources
        if re.search(r"__file__\)?\.?\w*\(?\)?\.parents?\b", p.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_write_json_is_one_compact_line_that_reads_back(tmp_path):
    data = {"runs": [{"loss": [2.5, None, 1e-3]}], "seed": 0, "label": "clip at 1"}
    path = tmp_path / "new" / "folder" / "data.json"
    size = stored.write_json(path, data)
    text = path.read_text()
    assert size == path.stat().st_size == len(text.encode())
    assert text.endswith("\n") and text.count("\n") == 1 and ", " not in text
    assert json.loads(text) == data
