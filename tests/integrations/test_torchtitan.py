"""The torchtitan recipe against torchtitan 0.3.0's own code, on 2 gloo ranks.

torchtitan's ``Trainer`` needs its data and model stack (torchdata, datasets, a
tokenizer), so it does not run here; its optimizer block does. ``Trainer.train_step``
(``torchtitan/trainer.py``) clips with ``torchtitan.distributed.utils.clip_grad_norm_``
(DTensor gradients reduced over their meshes, then over ``pp_mesh``), then calls
``self.optimizers.step()`` (an ``OptimizersContainer`` of one optimizer per model part
and optimizer type) and ``self.lr_schedulers.step()``. The workers
(``titan_workers.py``) run that block with torchtitan's own function and container, on
FSDP2 over both ranks and on two pipeline stages whose parameters are DTensors.
"""

from __future__ import annotations

import math

import pytest
import titan_workers
import torch
import torch.multiprocessing as mp
from helpers import assert_same_bits

RANKS = range(titan_workers.WORLD)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("titan")
    mp.start_processes(
        titan_workers.run,
        args=(str(folder / "init"), str(folder), str(folder / "dcp")),
        nprocs=titan_workers.WORLD,
        start_method="spawn",
    )
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in RANKS]


@pytest.mark.parametrize("layout", ["fsdp_clip", "pp_clip"])
def test_clipping_matches_torchtitans_own(ranks, layout):
    for r in RANKS:
        seen = ranks[r][layout]
        assert_same_bits(seen["norm"], seen["titan_norm"], f"rank {r} norm")
        assert_same_bits(seen["grads"], seen["titan_grads"], f"rank {r} grads")
        assert seen["norm"].item() > titan_workers.MAX_NORM  # it did clip
    assert_same_bits(ranks[0][layout]["norm"], ranks[1][layout]["norm"])  # one global norm


IMPLEMENTATIONS = ["for-loop", "fused"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("recipe", ["primitives", "guard"])
def test_without_a_bad_batch_the_recipe_is_torchtitans_step(ranks, recipe, implementation):
    run = f"train/{implementation}"
    for r in RANKS:
        ours, titan = ranks[r][f"{run}/{recipe}/None"], ranks[r][f"{run}/titan/None"]
        assert_same_bits(ours["params"], titan["params"], f"rank {r} params")
        assert_same_bits(ours["optim"], titan["optim"], f"rank {r} optimizers")
        assert ours["norms"] == titan["norms"]
        assert ours["norms"][-1] < ours["norms"][0]  # it trains: the gradients shrink
    assert ranks[0][f"{run}/{recipe}/None"]["norms"] == ranks[1][f"{run}/{recipe}/None"]["norms"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("recipe", ["primitives", "guard"])
def test_nan_on_one_stage_skipped_exactly_on_every_rank(ranks, recipe, implementation):
    for r in RANKS:
        seen = ranks[r][f"train/{implementation}/{recipe}/2"]
        never = ranks[r][f"never/{implementation}"]
        assert math.isnan(seen["norms"][2])  # rank 0's own gradients were finite
        assert_same_bits(seen["params"], never["params"], f"rank {r} params")
        assert_same_bits(seen["optim"], never["optim"], f"rank {r} optimizers")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_torchtitan_alone_steps_on_nan(ranks, implementation):
    # The control: torchtitan 0.3.0's block clips by a NaN coefficient and steps.
    for r in RANKS:
        params = ranks[r][f"train/{implementation}/titan/2"]["params"]
        assert any(not torch.isfinite(p).all() for p in params.values())


def test_decisions_in_the_extra_metrics(ranks):
    # train_step's metrics_processor.log(..., extra_metrics=...) logs whatever it is given.
    for r in RANKS:
        rows = ranks[r]["train/for-loop/guard/2"]["metrics"]
        assert [row["gradlab/skipped"] for row in rows] == [0, 0, 1, 1]
        assert [row["gradlab/clip_rate"] for row in rows][-1] == rows[-1]["gradlab/clipped"] / 4
        assert math.isnan(rows[2]["gradlab/total_norm"])


def test_guard_state_through_dcp(ranks):
    for r in RANKS:
        seen = ranks[r]["checkpoint"]
        assert seen["restored"] == seen["saved"] and seen["step"] == 3
        assert (seen["saved"]["num_steps"], seen["saved"]["counts"][2]) == (3, 1)
