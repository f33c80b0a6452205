"""experiments/record_norm_traces.py: a short prefix of both runs reproduces the stored file."""

from __future__ import annotations

import json
import math

import experiment_scripts
import pytest
import torch

from gradlab_book.figures import adaptive

PREFIX = 40


@pytest.fixture(scope="module")
def stored() -> dict:
    return json.loads(adaptive.DATA_PATH.read_text())


@pytest.fixture(scope="module")
def rerun() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the script runs
    try:
        return adaptive.record_traces(steps=PREFIX)
    finally:
        torch.set_num_threads(threads)


def test_file_is_small_and_complete(stored):
    assert adaptive.DATA_PATH.stat().st_size <= 200_000
    for name in adaptive.TRACES:
        settings = stored["settings"][name]
        assert len(stored[name]["norms"]) == settings["steps"]
    assert len(stored["mlp"]["corrupted"]) == stored["settings"]["mlp"]["steps"]
    assert stored["settings"]["mlp"] == adaptive.MLP_RUN
    assert stored["settings"]["tanh"] == adaptive.TANH_RUN


@pytest.mark.parametrize("name", list(adaptive.TRACES))
def test_prefix_reproduces_the_stored_norms(stored, rerun, name):
    ours, theirs = rerun[name]["norms"], stored[name]["norms"][:PREFIX]
    assert all(math.isfinite(v) for v in ours)
    assert ours == pytest.approx(theirs, rel=1e-5)


def test_prefix_reproduces_the_corruption_and_the_losses(stored, rerun):
    assert rerun["mlp"]["corrupted"] == stored["mlp"]["corrupted"][:PREFIX]
    assert rerun["tanh"]["losses"] == pytest.approx(stored["tanh"]["losses"][:PREFIX], rel=1e-5)


def test_script_writes_the_same_prefix(tmp_path, monkeypatch):
    """The script's main writes JSON that load_traces reads (run on a short prefix)."""
    module = experiment_scripts.load("record_norm_traces")
    real = adaptive.record_traces
    monkeypatch.setattr(adaptive, "record_traces", lambda: real(steps=5))
    out = tmp_path / "traces.json"
    assert module.main(["--out", str(out)]) == 0
    data = adaptive.load_traces(out)
    assert len(data["mlp"]["norms"]) == 5 and data["mlp"]["corrupted"].dtype == bool
