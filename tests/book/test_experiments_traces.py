"""experiments/record_norm_traces.py: a short prefix of both runs reproduces the stored files.

``norm_traces_prefix.json`` holds the first 40 steps of both runs with the numeric
platform that computed them: a rerun matches it bit for bit on that platform, and
within a tolerance elsewhere. The stored traces, ``norm_traces.json``, carry no platform
(they were recorded before data files did), so their beginning is compared with the
rerun within the tolerance on every machine; a real change (another seed, a learning
rate 1 % higher) is shown to fall outside it. The MLP run is tame: on this machine's two
numeric configurations its first 40 norms agree with the traces to 4e-6. The tanh run
is chaotic (a last-bit difference grows about tenfold a step), so away from the
recording platform only its first two steps can be held to 1e-4; the chapters replay
the stored trace, which is the same data on every machine.
"""

from __future__ import annotations

import json
import math

import experiment_scripts
import pytest
import torch

from gradlab_book import stored as stored_data
from gradlab_book.figures import adaptive

PREFIX = {"mlp": 40, "tanh": 2}
RTOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # as the script runs


@pytest.fixture(scope="module")
def stored() -> dict:
    return json.loads(adaptive.DATA_PATH.read_text())


@pytest.fixture(scope="module")
def prefix() -> dict:
    return json.loads(adaptive.PREFIX_PATH.read_text())


@pytest.fixture(scope="module")
def rerun() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return adaptive.record_traces(steps=adaptive.PREFIX_STEPS)
    finally:
        torch.set_num_threads(threads)


RUNS = {"mlp": adaptive.MLP_RUN, "tanh": adaptive.TANH_RUN}


@pytest.mark.parametrize(("name", "key"), [("mlp", "norms"), ("tanh", "norms"), ("tanh", "losses")])
def test_prefix_reproduces_the_prefix_file(prefix, rerun, name, key):
    """All 40 steps bit for bit on the recording platform; elsewhere the steps the
    tolerance holds (the tanh run is chaotic)."""
    assert prefix["settings"][name] == dict(RUNS[name], steps=adaptive.PREFIX_STEPS)
    n = adaptive.PREFIX_STEPS if stored_data.same_platform(prefix) else PREFIX[name]
    ours, theirs = rerun[name][key][:n], prefix[name][key][:n]
    assert len(ours) == n and all(math.isfinite(v) for v in ours)
    experiment_scripts.assert_prefix_reproduces(ours, theirs, prefix, RTOL)
    if name == "mlp":
        assert rerun[name]["corrupted"] == prefix[name]["corrupted"]


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
    n = PREFIX[name]
    ours, theirs = rerun[name]["norms"][:n], stored[name]["norms"][:n]
    assert all(math.isfinite(v) for v in ours)
    experiment_scripts.assert_prefix_reproduces(ours, theirs, stored, RTOL)


def test_prefix_reproduces_the_corruption_and_the_losses(stored, rerun):
    n = PREFIX["mlp"]
    assert rerun["mlp"]["corrupted"][:n] == stored["mlp"]["corrupted"][:n]
    n = PREFIX["tanh"]
    ours, theirs = rerun["tanh"]["losses"][:n], stored["tanh"]["losses"][:n]
    experiment_scripts.assert_prefix_reproduces(ours, theirs, stored, RTOL)


def test_a_real_change_falls_outside_the_tolerance(stored):
    """Another seed of the MLP run and a learning rate 1 % higher for the tanh chain."""
    n = PREFIX["mlp"]
    other = adaptive.mlp_trace(**dict(adaptive.MLP_RUN, seed=1, steps=n))
    experiment_scripts.assert_outside(other["norms"], stored["mlp"]["norms"][:n], RTOL)
    n = PREFIX["tanh"]
    faster = dict(adaptive.TANH_RUN, lr=1.01 * adaptive.TANH_RUN["lr"], steps=n)
    other = adaptive.tanh_trace(**faster)
    experiment_scripts.assert_outside(other["norms"], stored["tanh"]["norms"][:n], RTOL)


def test_script_writes_the_same_prefix_with_the_platform(tmp_path, monkeypatch):
    """The script's main writes JSON that load_traces reads, and the prefix file (run
    on short prefixes: 5 steps for the traces, 3 for the prefix)."""
    module = experiment_scripts.load("record_norm_traces")
    real = adaptive.record_traces
    monkeypatch.setattr(
        adaptive, "record_traces", lambda steps=None: real(steps=5 if steps is None else 3)
    )
    out, first = tmp_path / "traces.json", tmp_path / "prefix.json"
    assert module.main(["--out", str(out), "--prefix-out", str(first)]) == 0
    data = adaptive.load_traces(out)
    assert len(data["mlp"]["norms"]) == 5 and data["mlp"]["corrupted"].dtype == bool
    assert stored_data.same_platform(data)
    prefix = json.loads(first.read_text())
    assert len(prefix["tanh"]["norms"]) == 3 and stored_data.same_platform(prefix)
    assert prefix["tanh"]["norms"] == data["tanh"]["norms"][:3].tolist()
