"""What the book times: the parameter sets, the reference loops and the floor (no timings),
and benchmarks/bench_clip.py, which times them on benchmarks/harness.py."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from clip_helpers import assert_all_plus_zero, assert_grads_unchanged, math_norm, snapshot

import gradlab
import gradlab_book.benchmark as benchmark
from gradlab.sync import HostReadError, no_host_reads
from gradlab_book.benchmark import (
    HUGE,
    IMPLEMENTATIONS,
    floor_norm,
    loop_ignore_norm_,
    loop_ignore_value_,
    make_parameters,
)

ROOT = Path(__file__).resolve().parents[2]


def test_make_parameters_sizes_and_seed():
    params = make_parameters(7, 100, seed=3)
    sizes = [p.numel() for p in params]
    assert sum(sizes) == 100 and max(sizes) - min(sizes) <= 1
    assert all(p.dtype == torch.float32 and p.grad.shape == p.shape for p in params)
    again = make_parameters(7, 100, seed=3)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(params, again, strict=True))
    other = make_parameters(7, 100, seed=4)
    assert not torch.equal(params[0].grad, other[0].grad)
    with pytest.raises(ValueError, match="n_tensors"):
        make_parameters(0, 10)


def test_no_timing_code_is_left_in_the_book():
    # benchmarks/harness.py is the one harness: the book keeps no clock of its own.
    names = set(vars(benchmark))
    assert not names & {"time_call", "time_calls", "benchmark_table", "time"}, names
    assert "perf_counter" not in Path(benchmark.__file__).read_text()


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_loop_ignore_norm_agrees_with_gradlab_on_finite_gradients(norm_type, factor):
    loop_params = make_parameters(5, 40, seed=1)
    ours = make_parameters(5, 40, seed=1)
    max_norm = factor * math_norm([p.grad for p in ours], norm_type)
    total_loop = loop_ignore_norm_(loop_params, max_norm, norm_type)
    total_ours = gradlab.grad_ignore_norm_(ours, max_norm, norm_type)
    assert math.isclose(float(total_loop), float(total_ours), rel_tol=1e-6)
    for a, b in zip(loop_params, ours, strict=True):
        assert torch.equal(a.grad, b.grad)


def test_loop_ignore_value_agrees_with_gradlab_on_finite_gradients():
    for clip_value in (0.1, 100.0):
        loop_params = make_parameters(5, 40, seed=2)
        ours = make_parameters(5, 40, seed=2)
        loop_ignore_value_(loop_params, clip_value)
        gradlab.grad_ignore_value_(ours, clip_value)
        for a, b in zip(loop_params, ours, strict=True):
            assert torch.equal(a.grad, b.grad)


def test_the_loop_keeps_its_known_defects():
    # What gradlab fixes: the loop lets a NaN gradient through, and fails on [].
    params = make_parameters(3, 30, seed=5)
    params[1].grad[2] = math.nan
    before = snapshot(params)
    loop_ignore_norm_(params, 1.0)
    assert_grads_unchanged(params, before)  # NaN < 1 is False: nothing ignored
    gradlab.grad_ignore_norm_(params, 1.0)
    assert_all_plus_zero(params)
    with pytest.raises(IndexError):
        loop_ignore_norm_([], 1.0)


def test_floor_norm_is_the_norm_of_the_flat_tensor():
    flat = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert math.isclose(float(floor_norm(flat)), math_norm([flat], 2.0), rel_tol=1e-6)
    assert float(floor_norm(flat, math.inf)) == float(flat.abs().max())


@pytest.mark.parametrize("loop", [loop_ignore_norm_, loop_ignore_value_])
def test_the_reference_loop_algorithm_syncs(loop):
    # The per-tensor loop of the reference text branches on a tensor in Python.
    params = make_parameters(3, 4, seed=0)
    with pytest.raises(HostReadError), no_host_reads():
        loop(params, 1.0)


def test_every_implementation_does_the_work_of_a_healthy_step():
    # Timed repeats must do the same work: HUGE is above every gradient, so nothing
    # is clipped or ignored, and each call leaves the gradients as torch's clip would.
    params = make_parameters(6, 60, seed=7)
    assert max(float(p.grad.abs().max()) for p in params) * 60 < HUGE
    before = snapshot(params)
    for fn in IMPLEMENTATIONS.values():
        fn(params)
        assert_grads_unchanged(params, before)
    assert len(IMPLEMENTATIONS) == 8


def test_bench_clip_writes_the_harness_json(tmp_path):
    out = tmp_path / "clip.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_clip.py"),
        "--tables",
        "sweep",
        "--sizes",
        "1,3",
        "--rounds",
        "2",
        "--block-ms",
        "0.2",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT / "benchmarks", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert set(data["tables"]) == {"sweep k=1", "sweep k=3"}
    rows = data["tables"]["sweep k=3"]
    names = [r["name"] for r in rows]
    assert names[:2] == ["floor_norm", "floor_sum"] and names[2:] == list(IMPLEMENTATIONS)
    floor = rows[0]
    assert floor["ratio_min"] == 1.0 and floor["ratio_paired"] == 1.0
    for r in rows:
        assert 0 < r["min_us"] <= r["median_us"]
        assert math.isclose(r["ratio_min"], r["min_us"] / floor["min_us"], rel_tol=1e-9)
    settings = data["settings"]
    assert settings["clock"].startswith("thread CPU time") and settings["rounds"] == 2
    assert "CPUs" in settings["machine"] and settings["sweep_elements"] == 1_000_000


def test_bench_clip_refuses_bad_options():
    script = str(ROOT / "benchmarks" / "bench_clip.py")
    for bad in (["--tables", "nonsense"], ["--sizes", "0"], ["--sizes", "a,b"]):
        done = subprocess.run(
            [sys.executable, script, *bad], cwd=ROOT / "benchmarks", capture_output=True, text=True
        )
        assert done.returncode == 2 and "error" in done.stderr, bad
