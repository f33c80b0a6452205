"""The privacy chapter's computations, against torch autograd, float64 numpy and Opacus."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from gradlab_book.figures import privacy as P

opacus = pytest.importorskip("opacus")
from opacus.accountants import RDPAccountant  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier  # noqa: E402

CORRUPTED = (1, 5)


@pytest.fixture(scope="module")
def batch():
    model = P.small_model()
    x, y = P.classification_data(12, corrupted=CORRUPTED, scale=3.0, seed=2)
    return model, x, y


def test_data_teacher_is_fixed_and_corrupted_labels_are_wrong():
    x1, y1 = P.classification_data(40, seed=1)
    x2, y2 = P.classification_data(40, corrupted=(3, 7), scale=3.0, seed=1)
    clean = [i for i in range(40) if i not in (3, 7)]
    assert torch.equal(x1[clean], x2[clean]) and torch.equal(y1[clean], y2[clean])
    assert torch.allclose(x2[3], 3.0 * x1[3]) and y2[3] != y1[3] and y2[7] != y1[7]
    # a different seed draws different inputs, labelled by the same teacher: a model
    # fitted on one seed's data fits another's
    model = P.trained_model(steps=200)
    x3, y3 = P.classification_data(200, seed=5)
    accuracy = (model(x3).argmax(1) == y3).double().mean().item()
    assert accuracy > 0.9


def test_loop_grads_add_up_to_the_batch_gradient(batch):
    model, x, y = batch
    grads = P.loop_grads(model, x, y)
    params = list(model.parameters())
    assert [g.shape[1:] for g in grads] == [p.shape for p in params]
    assert all(g.shape[0] == x.shape[0] for g in grads)
    total = torch.autograd.grad(P.loss_per_sample(model(x), y).sum(), params)
    for g, t in zip(grads, total, strict=True):
        torch.testing.assert_close(g.sum(0), t, rtol=1e-12, atol=1e-12)
    # and one row is that sample's own gradient
    one = torch.autograd.grad(P.loss_per_sample(model(x[3:4]), y[3:4]).sum(), params)
    for g, t in zip(grads, one, strict=True):
        torch.testing.assert_close(g[3], t, rtol=0, atol=0)


def test_clip_ignore_sweep_against_float64_numpy(batch):
    model, x, y = batch
    grads = P.loop_grads(model, x, y)
    clean = [i not in CORRUPTED for i in range(x.shape[0])]
    thresholds = [0.01, 0.3, 1.0, 3.0, 1e3]
    sweep = P.clip_ignore_sweep(grads, thresholds, clean)
    flat = np.concatenate([g.reshape(x.shape[0], -1).numpy() for g in grads], 1)
    norms = np.sqrt((flat**2).sum(1))
    np.testing.assert_allclose(sweep["norms"], norms, rtol=1e-12)
    ref = flat[np.asarray(clean)].mean(0)
    for k, c in enumerate(thresholds):
        ratio = c / (norms + 1e-6)
        clip = (np.minimum(1.0, ratio)[:, None] * flat).sum(0)
        ignore = flat[ratio >= 1.0].sum(0)
        for name, total in (("clip", clip), ("ignore", ignore)):
            np.testing.assert_allclose(sweep[f"{name}_norm"][k], np.linalg.norm(total), rtol=1e-10)
            if np.linalg.norm(total) == 0:
                assert math.isnan(sweep[f"{name}_cos"][k])
            else:
                cos = total @ ref / np.linalg.norm(total) / np.linalg.norm(ref)
                np.testing.assert_allclose(sweep[f"{name}_cos"][k], cos, rtol=1e-10)
        assert sweep["clipped"][k] == int((norms > c).sum())
    # far above every norm, clip and ignore are the plain sum
    assert sweep["clipped"][-1] == 0
    np.testing.assert_allclose(sweep["clip_norm"][-1], np.linalg.norm(flat.sum(0)), rtol=1e-12)
    assert sweep["clip_cos"][-1] == pytest.approx(sweep["ignore_cos"][-1], rel=1e-12)


def test_epsilon_curve_matches_the_rdp_accountant_step_by_step():
    sigma, q, delta = 1.1, 0.02, 1e-5
    steps = [1, 7, 30]
    eps = P.epsilon_curve(sigma, q, steps, delta)
    acc = RDPAccountant()
    done = 0
    for n, e in zip(steps, eps, strict=True):
        for _ in range(n - done):
            acc.step(noise_multiplier=sigma, sample_rate=q)
        done = n
        assert e == pytest.approx(acc.get_epsilon(delta), rel=1e-9)


def test_epsilon_without_subsampling_is_the_gaussian_rdp_formula():
    # q = 1: the Gaussian mechanism's RDP is alpha / (2 sigma^2) per step (Mironov
    # 2017), converted with eps = rdp + log((a-1)/a) - (log delta + log a)/(a-1)
    # (Balle et al. 2020, Theorem 21), minimised over Opacus's default orders.
    sigma, delta = 2.0, 1e-5
    alphas = np.asarray(RDPAccountant.DEFAULT_ALPHAS)
    for n in (1, 10, 100):
        rdp = n * alphas / (2 * sigma**2)
        conv = rdp + np.log((alphas - 1) / alphas) - (np.log(delta) + np.log(alphas)) / (alphas - 1)
        assert P.epsilon_curve(sigma, 1.0, [n], delta)[0] == pytest.approx(conv.min(), rel=1e-9)


def test_epsilon_grid_is_monotone_and_inverts_get_noise_multiplier():
    sigmas, rates, steps = [0.8, 1.0, 2.0], [0.001, 0.01], [10, 100, 1000, 10000]
    grid = P.epsilon_grid(sigmas, rates, steps, 1e-5)
    assert set(grid) == {(s, q) for s in sigmas for q in rates}
    for (s, q), eps in grid.items():
        assert np.all(np.diff(eps) > 0), (s, q)  # more steps: more epsilon
    for q in rates:
        by_sigma = [grid[(s, q)] for s in sigmas]
        assert all(np.all(a > b) for a, b in itertools.pairwise(by_sigma))  # more noise: less
    for s in sigmas:
        assert np.all(grid[(s, 0.01)] > grid[(s, 0.001)])  # more sampling: more
    sigma = get_noise_multiplier(
        target_epsilon=3.0, target_delta=1e-5, sample_rate=0.01, steps=1000
    )
    eps = P.epsilon_curve(sigma, 0.01, [1000], 1e-5)[0]
    assert 3.0 - 0.02 <= eps <= 3.0


def test_figures_draw():
    x, y = P.classification_data(8, corrupted=(2,), scale=3.0, seed=2)
    grads = P.loop_grads(P.small_model(), x, y)
    sweep = P.clip_ignore_sweep(grads, [0.01, 1.0, 100.0], [i != 2 for i in range(8)])
    for c in (0.01, 1.0, 100.0):
        assert isinstance(P.clip_ignore_figure(c, sweep), Figure)
    steps = [10, 100, 1000]
    grid = P.epsilon_grid([1.0, 2.0], [0.01], steps, 1e-5)
    fig = P.epsilon_figure(1.0, 0.01, grid, steps, 1e-5, mark=100)
    assert isinstance(fig, Figure)
    assert "after 100 steps" in fig.axes[0].get_title()


def test_figures_just_outside_their_sliders():
    # the explorables' sliders: C in [0.01, 100]; sigma and q from the grid; the mark
    x, y = P.classification_data(8, corrupted=(2,), scale=3.0, seed=2)
    grads = P.loop_grads(P.small_model(), x, y)
    sweep = P.clip_ignore_sweep(grads, [0.01, 1.0, 100.0], [i != 2 for i in range(8)])
    for c in (0.0, 1e-3, 150.0, 1e4, math.inf):
        assert isinstance(P.clip_ignore_figure(c, sweep), Figure)
    steps = [10, 100, 1000]
    grid = P.epsilon_grid([1.0, 2.0], [0.01], steps, 1e-5)
    # a sigma and a q the grid lacks, and a mark between its steps: computed (these
    # raised KeyError and ValueError)
    fig = P.epsilon_figure(0.5, 0.03, grid, steps, 1e-5, mark=300)
    want = P.epsilon_curve(0.5, 0.03, [300], 1e-5)[0]
    assert f"ε = {want:.3g}" in fig.axes[0].get_title()
    line = fig.axes[0].get_lines()[0]
    assert list(line.get_ydata()) == pytest.approx(list(P.epsilon_curve(0.5, 0.03, steps, 1e-5)))


def test_ghost_costs_count_both_forms():
    c = P.ghost_costs(128, 256, 128)
    assert c["gram_numbers"] == 2 * 128**2 and c["formed_numbers"] == 128 * 256
    assert c["gram_madds"] == 128**2 * 384 and c["formed_madds"] == 128 * 128 * 256
    assert c["memory_break_even_T"] == pytest.approx(128.0)  # sqrt(128 * 256 / 2)
    assert c["time_break_even_T"] == pytest.approx(128 * 256 / 384)
    # at the memory break-even the two forms hold as many numbers: 2 * 4**2 = 4 * 8
    assert P.ghost_costs(4, 8, 4)["gram_numbers"] == P.ghost_costs(4, 8, 4)["formed_numbers"]
    with pytest.raises(ValueError, match="seq_len"):
        P.ghost_costs(4, 4, 0)


def test_stored_costs_are_consistent():
    data = P.load_costs()
    assert data["timer"].startswith("thread CPU time") and data["threads"] == 1
    assert data["machine"] and data["torch"]
    tables = {t["seq_len"]: t for t in data["tables"]}
    assert set(tables) == {1, 128, 512}
    assert tables[1]["batch"] == 64 and tables[1]["parameters"] == 396_210
    assert data["rows"] == tables[1]["rows"]
    for table in tables.values():
        rows = {r["method"]: r for r in table["rows"]}
        assert {"non-private", "per-sample loop", "torch.func vmap", "gradlab ghost"} <= set(rows)
        base = rows["non-private"]["min_ms"]
        assert rows["non-private"]["ratio_to_non_private"] == 1.0
        for r in rows.values():
            assert r["min_ms"] <= r["median_ms"]
            # the ratios are of the unrounded minima: within rounding of the table's
            assert r["ratio_to_non_private"] == pytest.approx(r["min_ms"] / base, rel=0.05)
            if r["method"] != "non-private":
                assert r["max_abs_grad_diff_vs_loop"] < 1e-6
                assert r["paired_ratio_median"] > 0
