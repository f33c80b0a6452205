"""The two ranks of the torchtitan tests: gloo on the CPU, file:// rendezvous, one spawn.

Each rank runs every scenario and writes what it saw to ``out/rank{r}.pt``; the test
module reads both files. The scenarios call torchtitan's own clipping,
``torchtitan.distributed.utils.clip_grad_norm_``, and its own ``OptimizersContainer``,
on the layouts of ``Trainer.train_step`` (torchtitan 0.3.0, ``torchtitan/trainer.py``):
FSDP2 DTensor gradients, and pipeline stages (``pp_mesh``) whose parameters are
DTensors on a 1-rank data-parallel mesh.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

WORLD = 2
MAX_NORM, SKIP_ABOVE = 0.5, 50.0


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _grads(params):
    return [_local(p.grad).detach().clone() for p in params]


def _set_grads(params, grads):
    for p, g in zip(params, grads, strict=True):
        _local(p.grad).copy_(g)


def _batch(step, rank, width, bad=False):
    # One batch per rank, every step: the loss falls, so the gradients shrink.
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, width, generator=g)
    if bad:
        x[0, 0] = math.nan
    return x


def _stage(rank):
    """This rank's pipeline stage: the first or the second half of the tiny model."""
    from helpers import tiny_model

    net = tiny_model()
    return nn.Sequential(net[0], net[1]) if rank == 0 else nn.Sequential(net[2])


def _stage_input_width(rank):
    return 8 if rank == 0 else 16


def _backward(module, step, rank, bad=False):
    # A stand-in for the pipeline schedule: each stage backpropagates a loss of its own.
    x = _batch(step, rank, _stage_input_width(rank), bad)
    F.mse_loss(module(x), torch.zeros(4, 16 if rank == 0 else 1)).backward()


def _container(stage, implementation="for-loop"):
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    config = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=r"\.bias$", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-2}
            ),
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1},
            ),
        ],
        implementation=implementation,
    )
    return OptimizersContainer(config, model_parts=[stage])


def _inner_states(container):
    return [{"state": _plain(o.state_dict())} for o in container.optimizers]


def _plain(value):
    """Local tensors in place of DTensors, recursively (for pickling and comparison)."""
    if isinstance(value, torch.Tensor):
        return _local(value).detach().clone()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _guard(optimizers, pp_mesh, **kwargs):
    """The guard of torchtitan's container: every stage's DTensor gradients, summed
    over the stages (norm_parts), one decision for all of them (process_group)."""
    import gradlab

    pp = pp_mesh.get_group()
    return gradlab.StepGuard(
        optimizers,
        mode="clip",
        threshold=MAX_NORM,
        process_group=pp,
        norm_parts=lambda params: [([p.grad for p in params], pp)],
        **kwargs,
    )


def _params(stage):
    return {k: _local(v).detach().clone() for k, v in stage.named_parameters()}


def fsdp_clip(rank):
    """FSDP2 over both ranks: torchtitan's clip_grad_norm_ against gradlab's."""
    from helpers import tiny_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed import utils as dist_utils

    import gradlab

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    model = tiny_model()
    fully_shard(model, mesh=mesh)
    x = _batch(0, rank, 8) * 3
    F.mse_loss(model(x), torch.ones(4, 1)).backward()
    params = list(model.parameters())
    assert all(type(p.grad).__name__ == "DTensor" for p in params)
    before = _grads(params)
    titan = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=None)
    titan_grads = _grads(params)
    _set_grads(params, before)
    ours = gradlab.clip_grad_norm_(params, MAX_NORM)
    return {
        "titan_norm": titan.clone(),
        "norm": ours.clone(),
        "titan_grads": titan_grads,
        "grads": _grads(params),
    }


def pp_clip(rank, pp_mesh):
    """Pipeline stages (pp=2, dp_shard=1): the call site with DTensor grads and pp_mesh."""
    from torchtitan.distributed import utils as dist_utils

    import gradlab

    stage = _dp_sharded_stage(rank)
    _backward(stage, 0, rank)
    params = list(stage.parameters())
    before = _grads(params)
    titan = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=pp_mesh)
    titan_grads = _grads(params)
    _set_grads(params, before)
    ours = gradlab.clip_grad_norm_(params, MAX_NORM, process_group=pp_mesh.get_group())
    return {
        "titan_norm": titan.clone(),
        "norm": ours.clone(),
        "titan_grads": titan_grads,
        "grads": _grads(params),
    }


_MESH = {}


def _dp_sharded_stage(rank):
    from torch.distributed.fsdp import fully_shard

    stage = _stage(rank)
    fully_shard(stage, mesh=_MESH["dp_shard"])  # a 1-rank mesh: DTensor parameters
    return stage


def pp_train(rank, pp_mesh, recipe, bad_step, implementation="for-loop"):
    """Four steps of the train_step's optim block, with a NaN at ``bad_step`` on rank 1
    only (None: never). ``recipe``: "titan" (torchtitan's own block), "primitives"
    (clip, keep_by_norm read once on the host, step_if_ per inner optimizer) or "guard"
    (StepGuard of the container, sync=True)."""
    from torchtitan.distributed import utils as dist_utils

    import gradlab
    from gradlab.integrations import guard_metrics

    stage = _dp_sharded_stage(rank)
    optimizers = _container(stage, implementation)
    guard = None
    if recipe == "guard":
        guard = _guard(optimizers, pp_mesh, skip_above=SKIP_ABOVE)
    params = [p for m in [stage] for p in m.parameters()]
    norms, metrics = [], []
    for step in range(4):
        optimizers.zero_grad()
        _backward(stage, step, rank, bad=step == bad_step and rank == 1)
        if recipe == "titan":
            grad_norm = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=pp_mesh)
            optimizers.step()
        elif recipe == "primitives":
            grad_norm = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=pp_mesh)
            # False for NaN/inf, and the same on every rank: grad_norm is the global norm.
            # Read once: step_if_(sync=False) cannot yet snapshot DTensor state, and
            # torchtitan's fused flag sits in the param groups (see the report).
            take = bool(gradlab.keep_by_norm(grad_norm, SKIP_ABOVE))
            for optimizer in optimizers.optimizers:
                gradlab.step_if_(optimizer, take)
        else:
            grad_norm = torch.tensor(guard.step().total_norm)
            metrics.append(guard_metrics(guard))
        norms.append(float(grad_norm))
    return {
        "params": _params(stage),
        "optim": _inner_states(optimizers),
        "norms": norms,
        "metrics": metrics,
        "guard_state": None if guard is None else guard.state_dict(),
    }


def pp_guard_checkpoint(rank, pp_mesh, folder):
    """The guard's state in torchtitan's train_state, through DCP save and load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.stateful import Stateful

    class TrainState(Stateful):
        # torchtitan's Trainer is the "train_state" Stateful (Trainer.state_dict returns
        # {"step", "ntokens_seen"}); the recipe adds the guard's state beside them.
        def __init__(self, guard):
            self.step, self.guard = 0, guard

        def state_dict(self):
            return {"step": self.step, "gradlab_guard": self.guard.state_dict()}

        def load_state_dict(self, state_dict):
            self.step = state_dict["step"]
            self.guard.load_state_dict(state_dict["gradlab_guard"])

    def make():
        stage = _dp_sharded_stage(rank)
        optimizers = _container(stage)
        guard = _guard(optimizers, pp_mesh)
        return stage, optimizers, guard

    stage, optimizers, guard = make()
    state = TrainState(guard)
    for step in range(3):
        optimizers.zero_grad()
        _backward(stage, step, rank, bad=step == 1 and rank == 1)
        guard.step()
        state.step += 1
    dcp.save({"train_state": state}, checkpoint_id=folder)
    _, _, fresh = make()
    restored = TrainState(fresh)
    dcp.load({"train_state": restored}, checkpoint_id=folder)
    return {"saved": guard.state_dict(), "restored": fresh.state_dict(), "step": restored.step}


def run(rank, init_file, out, folder):
    sys.path.insert(0, os.path.dirname(__file__))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        results = {"fsdp_clip": fsdp_clip(rank)}
        mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("pp", "dp_shard"))
        _MESH["dp_shard"] = mesh["dp_shard"]
        pp_mesh = mesh["pp"]
        results["pp_clip"] = pp_clip(rank, pp_mesh)
        for implementation in ("for-loop", "fused"):
            for recipe in ("titan", "primitives", "guard"):
                for bad in (None, 2):
                    key = f"train/{implementation}/{recipe}/{bad}"
                    results[key] = pp_train(rank, pp_mesh, recipe, bad, implementation)
            results[f"never/{implementation}"] = pp_train_never(rank, pp_mesh, implementation)
        results["checkpoint"] = pp_guard_checkpoint(rank, pp_mesh, folder)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def pp_train_never(rank, pp_mesh, implementation):
    """The reference: the same steps without the bad batch (steps 0, 1, 3)."""
    from torchtitan.distributed import utils as dist_utils

    stage = _dp_sharded_stage(rank)
    optimizers = _container(stage, implementation)
    params = list(stage.parameters())
    for step in (0, 1, 3):
        optimizers.zero_grad()
        _backward(stage, step, rank)
        dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=pp_mesh)
        optimizers.step()
    return {"params": _params(stage), "optim": _inner_states(optimizers)}
