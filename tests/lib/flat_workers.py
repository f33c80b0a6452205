"""The worker side of test_flat_distributed.py: flat gradients inside 2 gloo ranks.

One world of :data:`WORLD` ranks (``file://`` rendezvous, CPU) is started once per test
module; each rank runs every scenario and saves what it saw after each (``rank<r>.pt``),
or the traceback where one raised. The tests compare the ranks with each other and with
references computed on each rank from copies of its own gradients: float64 maths and
``torch.nn.utils`` (never gradlab's per-tensor path).

Run ``python tests/lib/flat_workers.py OUT_DIR`` to start the world by hand.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradlab
from gradlab.flat import coalesce, flatten_grads

WORLD = 2
COLLECTIVE_TIMEOUT_S = 45


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=gen), torch.randn(5, 4, generator=gen)


def _math_norm(grads: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([g.reshape(-1).double() for g in grads])))


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _clip_step(flat, params) -> dict:
    """Norm and clip through the FlatGrads, against float64 and torch's second phase."""
    grads = [p.grad for p in params if p.grad is not None]
    copies = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for c, g in zip(copies, grads, strict=True):
        c.grad = g.clone()
    expected = _math_norm(grads)
    torch_norm = float(torch.nn.utils.get_total_norm([c.grad for c in copies]))
    runs = flat.grads()
    norm = gradlab.clip_grad_norm_(flat, 0.5 * expected)
    torch.nn.utils.clip_grads_with_norm_(copies, 0.5 * expected, norm)
    return {
        "runs": len(runs),
        "no_copy": _storages(grads) == _storages(runs),
        "norm": float(norm),
        "expected": expected,
        "torch_norm": torch_norm,
        "buckets": len({id(g._base) for g in grads}),
        "clip_same": all(torch.equal(g, c.grad) for g, c in zip(grads, copies, strict=True)),
        "digest": torch.cat([g.reshape(-1) for g in grads]).double().sum().item(),
    }


def scenario_ddp(rank: int) -> dict:
    """DDP with gradient_as_bucket_view: its buckets used as they are, across a rebuild
    of the buckets and both forms of zero_grad."""
    ddp = DDP(_model(), gradient_as_bucket_view=True, bucket_cap_mb=0.0002)
    flat = flatten_grads(ddp)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    params = list(ddp.parameters())
    steps = []
    for step in range(5):
        opt.zero_grad(set_to_none=step % 2 == 1)
        x, y = _batch(rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        grads = [p.grad for p in params]
        listed = len(coalesce(grads))  # the slow path finds the same buckets
        record = _clip_step(flat, params)
        record["listed_runs"] = listed
        record["bucket_views"] = all(g._base is not None for g in grads)
        steps.append(record)
        opt.step()
    return {"steps": steps, "params": [p.detach().clone() for p in params]}


def scenario_ddp_unused(rank: int) -> dict:
    """find_unused_parameters=True with a layer that gets no gradient."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _model()
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    ddp = DDP(Net(), gradient_as_bucket_view=True, find_unused_parameters=True)
    flat = flatten_grads(ddp)
    params = list(ddp.parameters())
    steps = []
    for step in range(3):
        ddp.zero_grad(set_to_none=False)
        x, y = _batch(rank, step)
        nn.functional.mse_loss(ddp(x), y).backward()
        steps.append(_clip_step(flat, params))
    return {"steps": steps}


def scenario_refused(rank: int) -> dict:
    out = {}
    try:
        flatten_grads(DDP(_model()))
    except ValueError as exc:
        out["ddp_copy"] = str(exc)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[3], mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        flatten_grads(model)
    except ValueError as exc:
        out["fsdp"] = str(exc)
    # What FSDP2 does with the sharded gradients: on each rank, views of one storage per
    # fully_shard group (its reduce-scatter output); gradlab takes them as DTensors.
    x, y = _batch(rank, 0)
    nn.functional.mse_loss(model(x), y).backward()
    local = [p.grad.to_local() for p in model.parameters()]
    out["fsdp_storages"] = len(_storages(local))
    out["fsdp_views"] = all(t._base is not None for t in local)
    full = [p.grad.full_tensor() for p in model.parameters()]
    out["fsdp_total"] = float(gradlab.get_total_norm([p.grad for p in model.parameters()]))
    out["fsdp_expected"] = _math_norm(full)
    return out


def scenario_inner_flattened(rank: int) -> dict:
    """flatten_grads on the module, then DDP around it: refused at the first backward."""
    model = _model()
    flatten_grads(model)
    ddp = DDP(model, gradient_as_bucket_view=True)
    x, y = _batch(rank, 0)
    try:
        nn.functional.mse_loss(ddp(x), y).backward()
    except RuntimeError as exc:
        return {"error_text": str(exc)}
    return {"error_text": None}


SCENARIOS = {
    "ddp": scenario_ddp,
    "ddp_unused": scenario_ddp_unused,
    "refused": scenario_refused,
    "inner_flattened": scenario_inner_flattened,
}


def worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):  # gloo on the loopback, whatever the hostname
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    results: dict = {}
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        for name, scenario in SCENARIOS.items():
            try:
                results[name] = scenario(rank)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            torch.save(results, path + ".tmp")
            os.replace(path + ".tmp", path)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def start(out_dir: str, timeout_s: float = 240.0) -> list[dict]:
    """Start the world, wait for it (killing it after ``timeout_s``), return each rank's."""
    import torch.multiprocessing as mp

    init_file = os.path.join(out_dir, "init")
    if os.path.exists(init_file):
        os.remove(init_file)
    context = mp.start_processes(
        worker, args=(init_file, out_dir), nprocs=WORLD, join=False, start_method="spawn"
    )
    error = None
    try:
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                error = f"the ranks did not finish in {timeout_s:.0f} s"
                break
    except Exception as exc:  # a rank died: keep what the others saved
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    out = []
    for rank in range(WORLD):
        path = os.path.join(out_dir, f"rank{rank}.pt")
        saved = torch.load(path, weights_only=False) if os.path.exists(path) else {}
        out.append({"__error__": error, **saved})
    return out


if __name__ == "__main__":
    for rank, res in enumerate(start(sys.argv[1])):
        for name, value in res.items():
            print(rank, name, value if name == "__error__" else value.get("error", "ok"))
