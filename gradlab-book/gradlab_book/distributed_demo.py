r"""The multi-process demo of the chapter "Accumulation and many processes".

Two gloo ranks on the CPU, started once (``torch.multiprocessing``, the ``spawn``
method, a ``file://`` rendezvous in a temporary folder: no port is chosen or printed).
Each rank runs every scenario below and saves what it saw as JSON; the parent then
compares the ranks, prints one report in sections and writes the numbers it printed
(and the ranks' raw results) to ``demo.json`` in the output folder, for later cells
and for the tests:

``primitives``
    a gradient split by hand across the ranks: each rank's local norm, the global
    norm from :func:`gradlab.get_total_norm` with ``process_group=``, for p = 1, 2,
    inf; each rank's own keep decision at a threshold, and the agreed one
    (:func:`gradlab.distributed.all_reduce_keep`);
``nan_max``
    the pitfall: ``all_reduce`` MAX of a NaN on gloo depends on which rank holds it,
    SUM always propagates it, and a separate non-finite flag (what gradlab does)
    restores it;
``ddp``
    DistributedDataParallel, SGD with momentum, rank 1's batch spikes at one step: a
    loss-based skip decided by each rank alone makes the replicas diverge, the same
    rule reduced over the ranks keeps them bitwise identical; the DDP gradient norm
    is already global (the gradients are averaged before anyone measures them);
``fsdp``
    FSDP2 (``fully_shard``): each rank's shard norm, the global norm (gradlab and
    torch), a float64 single-process reference, the clip coefficient each rank would
    use alone; and a NaN in rank 1's shard, which torch's inf-norm loses;
``guard``
    (only where :class:`gradlab.StepGuard` takes ``process_group=``) the DDP run of
    ``ddp`` with a guard that skips by loss, local and with the group;
``parallel``
    tensor, pipeline and expert parallelism on the same two ranks: which entries each
    rank counts, the norm with :func:`gradlab.distributed.total_norm` against a float64
    reference, what counting the copies twice (or not reducing at all) gives, and a
    NaN in one rank's expert through the inf-norm.

The report's NaN section adds a row for NCCL, computed in the parent process and not
run (there is no GPU here): NCCL reduces float MAX with CUDA's ``fmaxf``, whose rule for
a NaN (return the other operand) is the rule of :func:`torch.fmax`.

Everything printed is rounded and seeded, with no port, pid, timing or address, so
that an executed notebook can compare it cell by cell.

Usage::

    python -m gradlab_book.distributed_demo [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gradlab
from gradlab.distributed import all_reduce_keep, total_norm

__all__ = ["WORLD", "main", "report", "run"]

#: The number of ranks.
WORLD = 2
#: Every collective gives up after this long, so that a failing rank never hangs.
COLLECTIVE_TIMEOUT_S = 60
#: DDP steps, and the step at which rank 1's batch has targets ``SPIKE`` times too large.
STEPS, SPIKE_STEP, SPIKE = 8, 3, 30.0
#: The loss-based skip rule of the DDP runs: keep when the loss is finite and below it.
LOSS_MAX = 20.0
#: The shapes of the hand-sharded gradient (split along dim 0 across the ranks).
SHAPES = ((6, 3), (5,), (4,))
#: The norm types of the primitives section.
NORM_TYPES = (1.0, 2.0, math.inf)
#: The FSDP model: 10 inputs, this many hidden units and outputs.
FSDP_HIDDEN, FSDP_OUT = 8, 4


# --------------------------------------------------------------------- shared data


def full_gradient(seed: int = 0) -> list[torch.Tensor]:
    """The whole (unsharded) gradient of the primitives section, the same on every rank.

    The rows of the first tensor grow, so that the two halves have different norms.
    """
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    out[0] = out[0] * torch.linspace(0.5, 3.0, SHAPES[0][0], dtype=torch.float64)[:, None]
    return [t.to(torch.float32) for t in out]


def shard(tensors: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s part of each tensor, split along dim 0."""
    return [torch.tensor_split(t, WORLD, dim=0)[rank].clone() for t in tensors]


def make_mlp(seed: int, hidden: int = 7, out_features: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, hidden), nn.Tanh(), nn.Linear(hidden, out_features))


def batch(rank: int, step: int, out_features: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step`` (rank 1's targets spike at SPIKE_STEP)."""
    gen = torch.Generator().manual_seed(10_000 + 97 * rank + step)
    x = torch.randn(6, 10, generator=gen)
    y = torch.randn(6, out_features, generator=gen)
    if rank == 1 and step == SPIKE_STEP:
        y = y * SPIKE
    return x, y


def fsdp_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch for the FSDP model: the first two targets 8 times larger.

    FSDP2 shards every parameter by rows, so the last layer's rows for those two
    outputs, and their large gradients, sit on rank 0: its shard norm is the larger.
    """
    x, y = batch(rank, 0, FSDP_OUT)
    y = y.clone()
    y[:, :2] *= 8.0
    return x, y


def _floats(tensors) -> list[float]:
    """Every entry of ``tensors``, flattened, as Python floats (exact for float32)."""
    return [float(v) for t in tensors for v in t.detach().reshape(-1).tolist()]


# ----------------------------------------------------------------------- scenarios


def scenario_primitives(rank: int) -> dict:
    group = dist.group.WORLD
    local = shard(full_gradient(), rank)
    out: dict = {"local": {}, "global": {}}
    for p in NORM_TYPES:
        key = "inf" if p == math.inf else f"{p:g}"
        out["local"][key] = float(gradlab.get_total_norm(local, p))
        out["global"][key] = float(gradlab.get_total_norm(local, p, process_group=group))
    # Decisions at two thresholds, by the rule of grad_ignore_norm_ (keep iff
    # tau / (norm + 1e-6) >= 1), alone and agreed with all_reduce_keep.
    norm = gradlab.get_total_norm(local)
    for name, tau in thresholds().items():
        keep = tau / (norm + 1e-6) >= 1.0
        out[name] = {
            "tau": tau,
            "alone": bool(keep),
            "agreed": bool(all_reduce_keep(keep, group)),
            "by_global_norm": bool(
                tau / (gradlab.get_total_norm(local, process_group=group) + 1e-6) >= 1.0
            ),
        }
    return out


def thresholds() -> dict[str, float]:
    """The two thresholds of the primitives section, the same on both ranks.

    Both come from the rank norms of :func:`full_gradient`, computed here on every
    rank from the whole gradient (no collective): ``between`` lies between the two
    rank norms, ``above_both`` between the larger one and the global norm.
    """
    full = full_gradient()
    norms = sorted(float(gradlab.get_total_norm(shard(full, r))) for r in range(WORLD))
    total = float(gradlab.get_total_norm(full))
    return {
        "between": round((norms[0] + norms[1]) / 2, 2),
        "above_both": round((norms[1] + total) / 2, 2),
    }


def scenario_nan_max(rank: int) -> dict:
    """Raw MAX and SUM of a NaN held by one rank, and gradlab's flagged maximum."""
    out = {}
    for bad in range(WORLD):
        res = {}
        for name, op in (("max", dist.ReduceOp.MAX), ("sum", dist.ReduceOp.SUM)):
            t = torch.tensor([math.nan if rank == bad else 1.0])
            dist.all_reduce(t, op=op)
            res[name] = float(t)
        # A value and its NaN flag in one tensor, reduced by one MAX.
        value = torch.tensor(math.nan if rank == bad else 1.0)
        packed = torch.stack([torch.nan_to_num(value, nan=-math.inf), torch.isnan(value).float()])
        dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        res["max_with_flag"] = float(torch.where(packed[1] > 0, math.nan, packed[0]))
        grads = shard(full_gradient(), rank)
        if rank == bad:
            grads[0].view(-1)[0] = math.nan
        res["gradlab_inf"] = float(
            gradlab.get_total_norm(grads, math.inf, process_group=dist.group.WORLD)
        )
        out[str(bad)] = res
    return out


def _ddp_run(rank: int, rule: str) -> dict:
    """STEPS steps of DDP, SGD with momentum, skipping by ``rule`` (local or reduced)."""
    ddp = nn.parallel.DistributedDataParallel(make_mlp(0))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    skipped, losses, norms = [], [], []
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        norms.append(float(gradlab.get_total_norm([p.grad for p in ddp.parameters()])))
        keep = torch.isfinite(loss) & (loss < LOSS_MAX)
        if rule == "reduced":
            keep = all_reduce_keep(keep)
        if bool(keep):
            opt.step()
        skipped.append(not bool(keep))
        losses.append(float(loss.detach()))
    return {
        "params": _floats(ddp.module.parameters()),
        "skipped": skipped,
        "losses": losses,
        "norms": norms,
    }


def scenario_ddp(rank: int) -> dict:
    return {rule: _ddp_run(rank, rule) for rule in ("local", "reduced")}


def scenario_fsdp(rank: int) -> dict:
    """FSDP2 on gloo: shard norms, the global norm, a float64 reference, a NaN."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    model = make_mlp(1, FSDP_HIDDEN, FSDP_OUT)
    reference = make_mlp(1, FSDP_HIDDEN, FSDP_OUT).double()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x, y = fsdp_batch(rank)
    nn.functional.mse_loss(model(x), y).backward()
    # One process, float64: the mean of both ranks' losses (what FSDP averages).
    losses = [
        nn.functional.mse_loss(reference(a.double()), b.double())
        for a, b in map(fsdp_batch, range(WORLD))
    ]
    (sum(losses) / WORLD).backward()
    ref = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    grads = [p.grad for p in model.parameters()]
    out: dict = {
        "placements": sorted({str(g.placements) for g in grads}),
        "shard_numel": sum(g.to_local().numel() for g in grads),
        "numel": sum(g.numel() for g in grads),
    }
    for p in (2.0, math.inf):
        key = "inf" if p == math.inf else "2"
        out["local", key] = float(gradlab.get_total_norm([g.to_local() for g in grads], p))
        out["gradlab", key] = float(gradlab.get_total_norm(grads, p))
        # full_tensor() may return an async collective's result; float() waits for it
        out["torch", key] = float(torch.nn.utils.get_total_norm(grads, p).full_tensor())
        out["reference", key] = float(torch.linalg.vector_norm(ref, p))
    # a NaN in rank 1's shard only
    if rank == 1:
        grads[0].to_local().view(-1)[0] = math.nan
    for p in (2.0, math.inf):
        key = "inf" if p == math.inf else "2"
        out["nan_gradlab", key] = float(gradlab.get_total_norm(grads, p))
        out["nan_torch", key] = float(torch.nn.utils.get_total_norm(grads, p).full_tensor())
    return {"|".join(k) if isinstance(k, tuple) else k: v for k, v in out.items()}


def scenario_guard(rank: int) -> dict:
    """The DDP run with StepGuard(loss_threshold=...), alone and with process_group."""
    out: dict = {}
    for name, group in (("local", None), ("group", dist.group.WORLD)):
        ddp = nn.parallel.DistributedDataParallel(make_mlp(0))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        # DDP: every rank holds the averaged gradient, so grads="replicated"
        kwargs = {} if group is None else {"process_group": group, "grads": "replicated"}
        guard = gradlab.StepGuard(
            opt, mode="skip", threshold=math.inf, loss_threshold=LOSS_MAX, **kwargs
        )
        decisions = []
        for step in range(STEPS):
            x, y = batch(rank, step)
            opt.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            decisions.append(guard.step(loss=loss).decision)
        out[name] = {"params": _floats(ddp.module.parameters()), "decisions": decisions}
    return out


def parallel_model(seed: int = 2) -> dict[str, list[torch.Tensor]]:
    """The whole gradient of the ``parallel`` scenario, the same on every rank.

    ``tp_sharded``: a column-parallel weight (split by rows) and a row-parallel weight
    (split by columns); ``tp_copies``: a LayerNorm weight and the row-parallel layer's
    bias, which every TP rank holds whole; ``stages``: the layers of pipeline stage 0
    and of stage 1; ``dense`` and ``experts``: a router and the attention held by every
    expert-parallel rank, and one expert per rank.
    """
    gen = torch.Generator().manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(torch.float32)

    return {
        "tp_sharded": [t(6, 4), t(4, 6)],
        "tp_copies": [t(4), t(4)],
        "stage0": [t(5, 3), t(5)],
        "stage1": [t(3, 5) * 2, t(3)],
        "dense": [t(2, 4), t(4, 4)],
        "experts": [t(4, 8), t(4, 8) * 3],
    }


def parallel_parts(rank: int) -> dict[str, list[torch.Tensor]]:
    """What rank ``rank`` holds of :func:`parallel_model` under each layout."""
    full = parallel_model()
    col, row = full["tp_sharded"]
    return {
        "tp_sharded": [col.chunk(WORLD, 0)[rank].clone(), row.chunk(WORLD, 1)[rank].clone()],
        "tp_copies": [c.clone() for c in full["tp_copies"]],
        "stage": [s.clone() for s in full[f"stage{rank}"]],
        "dense": [d.clone() for d in full["dense"]],
        "expert": [full["experts"][rank].clone()],
    }


def _reference(tensors: list[torch.Tensor], p: float = 2.0) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in tensors]), p))


def scenario_parallel(rank: int) -> dict:
    """TP, PP and EP on the two ranks: the local norms, total_norm, the mistakes."""
    group = dist.group.WORLD
    mine, full = parallel_parts(rank), parallel_model()
    tp_all = mine["tp_sharded"] + mine["tp_copies"]
    out: dict = {
        "tp": {
            "alone": float(gradlab.get_total_norm(tp_all)),
            "copies_twice": float(gradlab.get_total_norm(tp_all, process_group=group)),
            "total_norm": float(
                total_norm([(mine["tp_sharded"], group), (mine["tp_copies"], None)])
            ),
            # Megatron-LM's rule: copies counted on TP rank 0 only, one reduction
            "megatron": float(
                gradlab.get_total_norm(
                    mine["tp_sharded"] + (mine["tp_copies"] if rank == 0 else []),
                    process_group=group,
                )
            ),
            "reference": _reference(full["tp_sharded"] + full["tp_copies"]),
        },
        "pp": {
            "alone": float(gradlab.get_total_norm(mine["stage"])),
            "total_norm": float(total_norm([(mine["stage"], group)])),
            "reference": _reference(full["stage0"] + full["stage1"]),
        },
        "ep": {
            "alone": float(gradlab.get_total_norm(mine["dense"] + mine["expert"])),
            "dense_twice": float(
                gradlab.get_total_norm(mine["dense"] + mine["expert"], process_group=group)
            ),
            "total_norm": float(total_norm([(mine["dense"], None), (mine["expert"], group)])),
            "reference": _reference(full["dense"] + full["experts"]),
        },
    }
    expert = [e.clone() for e in mine["expert"]]
    if rank == 1:
        expert[0].view(-1)[0] = math.nan
    out["ep"]["nan_inf_norm"] = float(
        total_norm([(mine["dense"], None), (expert, group)], math.inf)
    )
    return out


SCENARIOS = {
    "primitives": scenario_primitives,
    "nan_max": scenario_nan_max,
    "ddp": scenario_ddp,
    "fsdp": scenario_fsdp,
    "guard": scenario_guard,
    "parallel": scenario_parallel,
}


def nccl_max(values: list[float]) -> float:
    """An all-reduce MAX as NCCL computes it for float, ``fmaxf`` folded over the ranks.

    :func:`torch.fmax` has fmaxf's rule (IEEE 754 maxNum): if one operand is NaN, the
    other is returned. Emulated here, not run: this machine has no GPU.
    """
    out = torch.tensor(values[0], dtype=torch.float32)
    for v in values[1:]:
        out = torch.fmax(out, torch.tensor(v, dtype=torch.float32))
    return float(out)


# -------------------------------------------------------------------------- worker


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    """One rank: join, run every scenario, save the results as JSON, always leave."""
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
    try:
        for name, scenario in SCENARIOS.items():
            try:
                results[name] = scenario(rank)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()  # a rank that failed waits here, not in the next scenario
    finally:
        path = Path(out_dir) / f"rank{rank}.json"
        path.write_text(json.dumps(results), encoding="utf-8")
        dist.destroy_process_group()


def run(out_dir: str | os.PathLike, timeout_s: float = 240.0) -> list[dict]:
    """Start the two ranks once, wait for them, return what each saved."""
    import torch.multiprocessing as mp

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    init_file = out_dir / "rendezvous"
    for stale in [init_file, *out_dir.glob("rank*.json")]:
        stale.unlink(missing_ok=True)
    context = mp.start_processes(
        _worker,
        args=(str(init_file), str(out_dir)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    error = None
    try:
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                error = f"the ranks did not finish in {timeout_s:.0f} s"
                break
    except Exception as exc:  # a rank died
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    if error is not None:
        raise RuntimeError(error)
    ranks = []
    for rank in range(WORLD):
        ranks.append(json.loads((out_dir / f"rank{rank}.json").read_text(encoding="utf-8")))
    for name in SCENARIOS:
        for rank, res in enumerate(ranks):
            if "error" in res.get(name, {"error": "missing"}):
                raise RuntimeError(f"rank {rank} failed in {name!r}:\n{res[name]['error']}")
    return ranks


# -------------------------------------------------------------------------- report


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _bitwise(a: list[float], b: list[float]) -> bool:
    """Equal bit for bit (the floats are float32 values, exact in JSON)."""
    return len(a) == len(b) and all(
        (x == y and math.copysign(1, x) == math.copysign(1, y)) or (x != x and y != y)
        for x, y in zip(a, b, strict=True)
    )


def _n(x: float, digits: int = 4) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def summarise(ranks: list[dict]) -> dict:
    """The numbers the report prints, computed from the ranks' raw results."""
    prim = [r["primitives"] for r in ranks]
    nan = ranks[0]["nan_max"]
    ddp = [r["ddp"] for r in ranks]
    fsdp = [r["fsdp"] for r in ranks]
    guard = [r["guard"] for r in ranks]
    s: dict = {"world": WORLD}
    s["primitives"] = {
        "local": {p: [pr["local"][p] for pr in prim] for p in prim[0]["local"]},
        "global": {p: [pr["global"][p] for pr in prim] for p in prim[0]["global"]},
        "decisions": {
            name: {
                "tau": prim[0][name]["tau"],
                "alone": [pr[name]["alone"] for pr in prim],
                "agreed": [pr[name]["agreed"] for pr in prim],
                "by_global_norm": [pr[name]["by_global_norm"] for pr in prim],
            }
            for name in ("between", "above_both")
        },
    }
    s["nan_max"] = {bad: nan[bad] for bad in nan}
    # NCCL's MAX (fmaxf), emulated: rank `bad` holds NaN, the others 1.0
    s["nan_max_nccl"] = {
        bad: nccl_max([math.nan if r == int(bad) else 1.0 for r in range(WORLD)]) for bad in nan
    }
    s["nan_max_ranks_agree"] = all(
        _bitwise(list(r["nan_max"][b].values()), list(nan[b].values())) for r in ranks for b in nan
    )
    s["ddp"] = {}
    for rule in ("local", "reduced"):
        runs = [d[rule] for d in ddp]
        s["ddp"][rule] = {
            "skipped": [run["skipped"] for run in runs],
            "spike_losses": [run["losses"][SPIKE_STEP] for run in runs],
            "max_param_diff": _max_diff(runs[0]["params"], runs[1]["params"]),
            "bitwise_identical": _bitwise(runs[0]["params"], runs[1]["params"]),
            "norms_identical": _bitwise(runs[0]["norms"], runs[1]["norms"]),
        }
    s["fsdp"] = {
        "placements": fsdp[0]["placements"],
        "shard_numel": [f["shard_numel"] for f in fsdp],
        "numel": fsdp[0]["numel"],
    }
    for key in ("2", "inf"):
        s["fsdp"][key] = {
            "local": [f[f"local|{key}"] for f in fsdp],
            "gradlab": [f[f"gradlab|{key}"] for f in fsdp],
            "torch": [f[f"torch|{key}"] for f in fsdp],
            "reference": fsdp[0][f"reference|{key}"],
            "nan_gradlab": [f[f"nan_gradlab|{key}"] for f in fsdp],
            "nan_torch": [f[f"nan_torch|{key}"] for f in fsdp],
        }
    par = [r["parallel"] for r in ranks]
    s["parallel"] = {
        layout: {key: [p[layout][key] for p in par] for key in par[0][layout]}
        for layout in ("tp", "pp", "ep")
    }
    s["guard"] = {}
    for name in ("local", "group"):
        runs = [g[name] for g in guard]
        s["guard"][name] = {
            "decisions": [run["decisions"] for run in runs],
            "max_param_diff": _max_diff(runs[0]["params"], runs[1]["params"]),
            "bitwise_identical": _bitwise(runs[0]["params"], runs[1]["params"]),
        }
    return s


def report(s: dict) -> str:
    """The printed report: one section per scenario, rounded, nothing variable."""
    lines: list[str] = []
    add = lines.append
    prim = s["primitives"]
    add(f"== 1. Norms over {s['world']} ranks (a gradient split by hand) ==")
    for p, local in prim["local"].items():
        glob = prim["global"][p]
        same = "same on both ranks" if glob[0] == glob[1] else "DIFFERENT on the ranks"
        shown = ", ".join(_n(v) for v in local)
        add(f"p = {p:>3}: local norms {shown}; global {_n(glob[0])} ({same})")
    for name, d in prim["decisions"].items():
        yes = {True: "keep", False: "skip"}
        add(
            f"tau = {d['tau']:g} ({name.replace('_', ' ')}): each rank alone "
            f"{', '.join(yes[v] for v in d['alone'])}; all_reduce_keep "
            f"{', '.join(yes[v] for v in d['agreed'])}; by the global norm "
            f"{', '.join(yes[v] for v in d['by_global_norm'])}"
        )
    add("")
    add("== 2. all_reduce of a NaN held by one rank (gloo) ==")
    for bad, res in s["nan_max"].items():
        add(
            f"NaN on rank {bad}: MAX {_n(res['max'])}, SUM {_n(res['sum'])}, "
            f"MAX with a NaN flag {_n(res['max_with_flag'])}, "
            f"gradlab inf-norm {_n(res['gradlab_inf'])}"
        )
    add(f"every rank got the same results: {s['nan_max_ranks_agree']}")
    nccl = "; ".join(f"NaN on rank {b}: MAX {_n(v)}" for b, v in s["nan_max_nccl"].items())
    add(f"NCCL (float MAX is fmaxf; emulated with torch.fmax, not run): {nccl}")
    add("")
    add(f"== 3. DDP, {STEPS} steps; rank 1's loss spikes at step {SPIKE_STEP} ==")
    for rule, d in s["ddp"].items():
        skipped = [[i for i, v in enumerate(sk) if v] for sk in d["skipped"]]
        add(
            f"{rule:>7} rule (loss < {LOSS_MAX:g}): steps skipped on rank 0 {skipped[0]}, "
            f"rank 1 {skipped[1]}"
        )
        add(
            f"        max |rank 0 - rank 1| over the parameters: {_n(d['max_param_diff'], 3)}"
            f"; bitwise identical: {d['bitwise_identical']}"
        )
    losses = ", ".join(_n(v, 3) for v in s["ddp"]["local"]["spike_losses"])
    add(f"losses at step {SPIKE_STEP} on ranks 0, 1: {losses}")
    same = all(d["norms_identical"] for d in s["ddp"].values())
    add(f"gradient norms after DDP's all-reduce, same bits on both ranks: {same}")
    add("")
    f = s["fsdp"]
    add("== 4. FSDP2 (fully_shard), gradients sharded over the ranks ==")
    add(
        f"placements {', '.join(f['placements'])}; entries per rank "
        f"{', '.join(str(n) for n in f['shard_numel'])} of {f['numel']}"
    )
    for key, label in (("2", "2-norm"), ("inf", "inf-norm")):
        d = f[key]
        add(
            f"{label:>8}: shard norms {', '.join(_n(v, 3) for v in d['local'])}; "
            f"global {_n(d['gradlab'][0], 3)} (gradlab), {_n(d['torch'][0], 3)} (torch), "
            f"float64 reference {_n(d['reference'], 3)}"
        )
    d2 = f["2"]
    root = math.sqrt(sum(v * v for v in d2["local"]))
    add(
        f"sqrt(sum of squared shard norms) = {_n(root, 3)}; max of shard inf-norms = "
        f"{_n(max(f['inf']['local']), 3)}"
    )
    tau = round(0.5 * d2["reference"], 1)
    coefs = ", ".join(_n(min(1.0, tau / (v + 1e-6)), 3) for v in d2["local"])
    add(
        f"clip at tau = {tau:g}: coefficient by each rank's shard norm {coefs}; "
        f"by the global norm {_n(min(1.0, tau / (d2['gradlab'][0] + 1e-6)), 3)}"
    )
    add(
        "NaN in rank 1's shard: gradlab 2-norm "
        f"{', '.join(_n(v) for v in f['2']['nan_gradlab'])}, inf-norm "
        f"{', '.join(_n(v) for v in f['inf']['nan_gradlab'])}; torch 2-norm "
        f"{', '.join(_n(v) for v in f['2']['nan_torch'])}, inf-norm "
        f"{', '.join(_n(v, 3) for v in f['inf']['nan_torch'])} (ranks 0, 1)"
    )
    add("")
    add("== 5. StepGuard(..., process_group=) on the DDP run of section 3 ==")
    for name in ("local", "group"):
        d = s["guard"][name]
        skipped = [[i for i, v in enumerate(dec) if v == "skipped"] for dec in d["decisions"]]
        label = "StepGuard(...)" if name == "local" else "StepGuard(..., process_group=pg)"
        add(
            f"{label}: skipped on rank 0 {skipped[0]}, rank 1 {skipped[1]}; "
            f"max |rank 0 - rank 1| {_n(d['max_param_diff'], 3)}; "
            f"bitwise identical: {d['bitwise_identical']}"
        )
    add("")
    add("== 6. Tensor, pipeline and expert parallelism: which entries each rank counts ==")
    par = s["parallel"]

    def pair(values: list[float]) -> str:
        return ", ".join(_n(v) for v in values)

    def agreed(values: list[float], reference: float) -> str:
        same = values[0] == values[1] and abs(values[0] - reference) <= 1e-6 * reference
        return "= the float64 reference, same on both ranks" if same else "WRONG"

    tp, pp, ep = par["tp"], par["pp"], par["ep"]
    add(
        f"TP: alone {pair(tp['alone'])}; every tensor summed over the group "
        f"{_n(tp['copies_twice'][0])} (the copies counted twice); total_norm "
        f"{_n(tp['total_norm'][0])} {agreed(tp['total_norm'], tp['reference'][0])}; "
        f"copies on TP rank 0 only (Megatron) {_n(tp['megatron'][0])}"
    )
    add(
        f"PP: each stage alone {pair(pp['alone'])}; total_norm over the stages "
        f"{_n(pp['total_norm'][0])} {agreed(pp['total_norm'], pp['reference'][0])}"
    )
    add(
        f"EP: alone {pair(ep['alone'])}; everything summed over the group "
        f"{_n(ep['dense_twice'][0])} (the dense part twice); total_norm "
        f"{_n(ep['total_norm'][0])} {agreed(ep['total_norm'], ep['reference'][0])}"
    )
    add(f"EP, a NaN in rank 1's expert: inf-norm by total_norm {pair(ep['nan_inf_norm'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for demo.json (default: a temporary one)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gradlab-dist-"))
    ranks = run(out)
    summary = summarise(ranks)
    (out / "demo.json").write_text(
        json.dumps({"summary": summary, "ranks": ranks}, indent=1), encoding="utf-8"
    )
    print(report(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
