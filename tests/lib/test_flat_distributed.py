"""Flat gradients across processes: DDP's bucket views used as they are, FSDP2 refused.

A module-scoped fixture starts one world of 2 gloo ranks on the CPU (``file://``
rendezvous) and runs every scenario of ``flat_workers.py`` in it; each test below checks
one scenario's results. References, computed on each rank from copies of its own
gradients: float64 maths and ``torch.nn.utils``.
"""

from __future__ import annotations

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import flat_workers as fw  # noqa: E402  (needs torch.distributed)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return fw.start(str(tmp_path_factory.mktemp("flat_dist")), timeout_s=300)


def _scenario(ranks, name):
    for r, res in enumerate(ranks):
        if name not in res:
            pytest.fail(f"rank {r} saved nothing for {name!r}: {res['__error__']}")
        if "error" in res[name]:
            pytest.fail(f"rank {r} raised in {name!r}:\n{res[name]['error']}")
    return [res[name] for res in ranks]


def _check_steps(steps) -> None:
    for s in steps:
        assert s["no_copy"], "the flat runs are not the storages of the gradients"
        assert s["clip_same"], "clip is not torch's coefficient times each entry"
        assert s["norm"] == pytest.approx(s["expected"], rel=1e-6)
        assert s["norm"] == pytest.approx(s["torch_norm"], rel=1e-6)


def test_ddp_bucket_views_are_the_flat_buffers_across_a_rebuild_and_set_to_none(ranks):
    results = _scenario(ranks, "ddp")
    for res in results:
        steps = res["steps"]
        _check_steps(steps)
        assert all(s["bucket_views"] for s in steps)
        # DDP starts with one bucket and rebuilds it into several after the first
        # iteration; the FlatGrads follows, one run per bucket, the list path alike.
        assert steps[0]["buckets"] == 1 and steps[-1]["buckets"] > 1
        assert all(s["runs"] == s["buckets"] == s["listed_runs"] for s in steps)
    # DDP averaged the gradients: every rank sees the same norm and takes the same step
    for a, b in zip(results[0]["steps"], results[1]["steps"], strict=True):
        assert a["norm"] == b["norm"] and a["digest"] == b["digest"]
    for p, q in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(p, q)


def test_ddp_with_unused_parameters(ranks):
    for res in _scenario(ranks, "ddp_unused"):
        _check_steps(res["steps"])


def test_ddp_without_bucket_views_and_fsdp2_are_refused_with_the_reason(ranks):
    for res in _scenario(ranks, "refused"):
        assert "gradient_as_bucket_view=True" in res["ddp_copy"]
        assert "third copy" in res["ddp_copy"]
        assert "FSDP2" in res["fsdp"] and "reduce-scatter" in res["fsdp"]
        # the finding the refusal rests on: one storage per fully_shard group (3 here)
        assert res["fsdp_views"] and res["fsdp_storages"] == 3
        # and the DTensor gradients work as they are
        assert res["fsdp_total"] == pytest.approx(res["fsdp_expected"], rel=1e-6)


def test_flattening_the_module_inside_ddp_is_refused_at_the_first_backward(ranks):
    for res in _scenario(ranks, "inner_flattened"):
        assert res["error_text"] is not None
        assert "flatten_grads on the DistributedDataParallel module" in res["error_text"]
