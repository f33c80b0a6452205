"""gradlab in torchtitan: the optimizer block of Trainer.train_step, skip instead of NaN.

    pip install gradlab "torchtitan==0.3.0"   # or a torchtitan checkout
    python torchtitan_optim_block.py         # 2 gloo ranks on the CPU, a few seconds

torchtitan's Trainer.train_step (torchtitan/trainer.py) ends with

    grad_norm = dist_utils.clip_grad_norm_(
        [p for m in self.model_parts for p in m.parameters()],
        self.config.training.max_norm, foreach=True,
        pp_mesh=parallel_dims.get_optional_mesh("pp"), ep_enabled=parallel_dims.ep_enabled,
    )
    self.checkpointer.maybe_wait_for_staging()
    self.optimizers.step()
    self.lr_schedulers.step()

grad_norm is the global norm (DTensor norms reduced over their meshes, then over the
pipeline stages), the same on every rank, so one keep from it is every rank's decision.
`optim_step` below is that block with the skip: paste its body into a Trainer subclass's
train_step (torchtitan is meant to be forked). Each inner optimizer of the
OptimizersContainer is skipped exactly with gradlab.step_if_; the container's own
step() is not called, so its step pre-hooks (MoE load balancing) do not run on any step:
with those hooks, use `gradlab.step_if_(self.optimizers, take)` instead (sync only).
The `main` below runs it on two pipeline stages whose parameters are FSDP2 DTensors.
"""

import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import gradlab

SKIP_ABOVE = 10.0  # skip a step whose global norm is above this, or NaN/inf


def optim_step(model_parts, optimizers, lr_schedulers, max_norm, pp_mesh, skipped):
    """torchtitan's optimizer block, a bad step skipped on every rank; returns grad_norm."""
    from torchtitan.distributed import utils as dist_utils

    grad_norm = dist_utils.clip_grad_norm_(
        [p for m in model_parts for p in m.parameters()], max_norm, foreach=True, pp_mesh=pp_mesh
    )
    # One host read, the same on every rank. (gradlab.step_if_(..., sync=False) would keep
    # it on the device, once the library handles DTensor optimizer state: see the notes.)
    take = bool(gradlab.keep_by_norm(grad_norm, SKIP_ABOVE))
    for optimizer in optimizers.optimizers:
        gradlab.step_if_(optimizer, take)
    if take:
        if lr_schedulers is not None:
            lr_schedulers.step()  # a skipped step does not advance the schedule
    else:
        skipped += 1
    return grad_norm, skipped


def main(rank, init_file):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import OptimizersContainer, default_adamw

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp_shard"))
    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    stage = full[:2] if rank == 0 else full[2:]  # two pipeline stages, one per rank
    fully_shard(stage, mesh=mesh["dp_shard"])
    optimizers = OptimizersContainer(default_adamw(lr=1e-2), model_parts=[stage])
    skipped = 0
    for step in range(8):
        optimizers.zero_grad()
        x = torch.randn(16, 8 if rank == 0 else 32)
        if step == 3 and rank == 1:
            x[0, 0] = math.nan  # a bad batch on the last stage only
        F.mse_loss(stage(x), torch.zeros(16, 32 if rank == 0 else 1)).backward()
        grad_norm, skipped = optim_step([stage], optimizers, None, 1.0, mesh["pp"], skipped)
        if rank == 0:
            print(f"step {step}: grad_norm {grad_norm.item():.4g}, skipped so far {skipped}")
    finite = all(bool(torch.isfinite(p.to_local()).all()) for p in stage.parameters())
    print(f"rank {rank}: weights finite: {finite}, skipped {skipped}")
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            main, args=(os.path.join(folder, "init"),), nprocs=2, start_method="spawn"
        )
