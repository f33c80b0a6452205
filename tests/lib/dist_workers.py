"""The worker side of test_distributed.py: scenarios run inside gloo ranks on the CPU.

One world of :data:`WORLD` ranks is started once; it also holds two 2-rank groups
(ranks 0-1 and 2-3, from ``new_group``), so each scenario runs at 2 ranks (both pairs
at once) and at 4. Each rank runs every scenario and saves what it saw after each one
(``rank<r>.pt`` in the output folder), or the traceback where one raised; the tests
compare the ranks with each other and with single-process references computed from the
same seeded data (the ``make_*`` and ``*_reference`` functions here).

Run ``python tests/lib/dist_workers.py OUT_DIR`` to start the world by hand. Another
module of scenarios (``parallel_workers.py``) runs in a world of its own through
:func:`start` with ``module=``.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import importlib
import math
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

import gradlab
from gradlab.distributed import all_reduce_keep
from gradlab.sync import HostReadCounter

WORLD = 4
#: Every collective gives up after this long, so a failing rank never hangs the others.
COLLECTIVE_TIMEOUT_S = 45
NORM_TYPES = (1.0, 2.0, 3.5, math.inf, 100.0)
SIZES = (2, 4)
#: Shapes of the hand-sharded tensors, split along dim 0; (1,) and (3,) leave empty shards.
SHAPES = ((13, 3), (7,), (5, 2, 2), (1,), (3,))
#: Entry scales: "large" overflows |g|^100 and "tiny" underflows it, in float32.
KINDS = {"normal": 2.0, "large": 300.0, "tiny": 1e-3}
STEPS = 8
SPIKE_STEP, NAN_STEP = 3, 5


# --------------------------------------------------------------------- shared data


def make_tensors(dtype: torch.dtype, kind: str, seed: int = 0) -> list[torch.Tensor]:
    """The full (unsharded) tensors, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(s, generator=gen, dtype=torch.float64) * KINDS[kind]).to(dtype) for s in SHAPES
    ]


def shard(tensors: list[torch.Tensor], size: int, index: int) -> list[torch.Tensor]:
    """Shard ``index`` of ``size`` of each tensor along dim 0 (some may be empty)."""
    return [torch.tensor_split(t, size, dim=0)[index].clone() for t in tensors]


def with_grads(grads: list[torch.Tensor]) -> list[nn.Parameter]:
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def step_grads(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(full gradient of w, gradient of the replicated b, the rank that spikes/NaNs)."""
    gen = torch.Generator().manual_seed(1000 + step)
    gw = torch.randn(12, generator=gen)
    gb = torch.randn(3, generator=gen)
    bad = size - 1
    pieces = list(torch.tensor_split(gw.clone(), size))
    if step == SPIKE_STEP:
        pieces[bad] = pieces[bad] * 1e3
    if step == NAN_STEP:
        pieces[bad] = pieces[bad].clone()
        pieces[bad][0] = math.nan
    return torch.cat(pieces), gb, bad


MAX_NORM = 10.0


def _adam(params):
    return torch.optim.Adam(params, lr=0.1, weight_decay=0.01)


def steps_reference(size: int) -> dict:
    """One process, the whole w: ignore by the norm of w's full gradient, then Adam."""
    w = nn.Parameter(torch.linspace(-1, 1, 12))
    b = nn.Parameter(torch.ones(3))
    opt = _adam([w, b])
    for step in range(STEPS):
        gw, gb, _ = step_grads(step, size)
        w.grad, b.grad = gw.clone(), gb.clone()
        norm = gradlab.get_total_norm([w.grad])
        gradlab.grad_ignore_with_norm_([w, b], MAX_NORM, norm)
        opt.step()
    return {"w": w.detach().clone(), "b": b.detach().clone(), "state": _state(opt)}


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            out.extend(st[k].clone() for k in sorted(st))
    return out


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        # bytes(tolist()), not .numpy(): the library suite runs without numpy.
        h.update(bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).tolist()))
    return h.hexdigest()


def make_mlp(seed: int, hidden: int = 7, out_features: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, hidden), nn.Tanh(), nn.Linear(hidden, out_features))


def batch(
    rank: int, step: int = 0, spike: float = 1.0, out_features: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 + 97 * rank + step)
    x = torch.randn(6, 10, generator=gen)
    y = torch.randn(6, out_features, generator=gen) * spike
    return x, y


# ----------------------------------------------------------------------- scenarios


class Ctx:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pair = None

    def group(self, size: int):
        return dist.group.WORLD if size == WORLD else self.pair

    def grank(self, size: int) -> int:
        return dist.get_rank(self.group(size))


def scenario_norms(ctx: Ctx) -> dict:
    """Hand-sharded norms, clip and ignore with process_group."""
    out = {}
    for size in SIZES:
        group, gr = ctx.group(size), ctx.grank(size)
        for dtype in (torch.float32, torch.float64):
            for kind in KINDS:
                local = shard(make_tensors(dtype, kind), size, gr)
                for p in NORM_TYPES:
                    total = gradlab.get_total_norm(local, p, process_group=group)
                    out["norm", size, str(dtype), kind, p] = total
                    out["local", size, str(dtype), kind, p] = gradlab.get_total_norm(local, p)
        full = make_tensors(torch.float32, "normal")
        local = shard(full, size, gr)
        for p in NORM_TYPES:
            ref = float(gradlab.get_total_norm(full, p))
            params = with_grads(local)
            norm = gradlab.clip_grad_norm_(params, 0.5 * ref, p, process_group=group)
            out["clip", size, p] = (norm, [q.grad for q in params])
            for name, factor in (("ignore_over", 0.95), ("ignore_under", 1.05)):
                params = with_grads(local)
                norm = gradlab.grad_ignore_norm_(params, factor * ref, p, process_group=group)
                alone = with_grads(local)
                gradlab.grad_ignore_norm_(alone, factor * ref, p)
                out[name, size, p] = (norm, [q.grad for q in params], [q.grad for q in alone])
        peak = float(gradlab.get_total_norm(full, math.inf))
        for name, thr in (("value_over", peak), ("value_under", peak * 1.01)):
            params = with_grads(local)
            largest = gradlab.grad_ignore_value_(params, thr, process_group=group)
            alone = with_grads(local)
            gradlab.grad_ignore_value_(alone, thr)
            out[name, size] = (largest, [q.grad for q in params], [q.grad for q in alone])
        with HostReadCounter() as reads:
            gradlab.clip_grad_norm_(with_grads(local), 1.0, process_group=group)
            gradlab.grad_ignore_norm_(with_grads(local), 1.0, 100.0, process_group=group)
            gradlab.grad_ignore_value_(with_grads(local), 1.0, process_group=group)
        out["host_reads", size] = reads.operations
    return out


def scenario_nonfinite(ctx: Ctx) -> dict:
    """A NaN or an inf on one rank only; and the raw all-reduce MAX pitfall."""
    out = {}
    for size in SIZES:
        group, gr = ctx.group(size), ctx.grank(size)
        local = shard(make_tensors(torch.float32, "normal"), size, gr)
        for bad in range(size):
            raw = {}
            for name, op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
                t = torch.tensor([math.nan if gr == bad else 1.0])
                dist.all_reduce(t, op=op, group=group)
                raw[name] = float(t)
            t = torch.tensor([math.nan if gr == bad else 1.0])
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
            raw["sum"] = float(t)
            out["raw", size, bad] = raw
            for value in (math.nan, math.inf):
                grads = [g.clone() for g in local]
                if gr == bad:
                    grads[0].view(-1)[0] = value
                res = {}
                for p in (2.0, math.inf, 100.0):
                    res["norm", p] = float(gradlab.get_total_norm(grads, p, process_group=group))
                params = with_grads(grads)
                res["ignore_norm"] = float(
                    gradlab.grad_ignore_norm_(params, 1e30, process_group=group)
                )
                res["ignore_norm_zero"] = all(bool((q.grad == 0).all()) for q in params)
                params = with_grads(grads)
                gradlab.grad_ignore_value_(params, 1e30, process_group=group)
                res["ignore_value_zero"] = all(bool((q.grad == 0).all()) for q in params)
                params = with_grads(grads)
                res["clip_norm"] = float(gradlab.clip_grad_norm_(params, 1.0, process_group=group))
                out["bad", size, bad, str(value)] = res
    return out


def ddp_clip_reference(size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One process, float64: the group's batches concatenated, clip, SGD momentum."""
    model = make_mlp(0).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    norms = []
    for step in range(STEPS):
        batches = [batch(r, step) for r in range(size)]
        x = torch.cat([b[0] for b in batches]).double()
        y = torch.cat([b[1] for b in batches]).double()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(gradlab.clip_grad_norm_(model.parameters(), 0.1))
        opt.step()
    return [q.detach() for q in model.parameters()], torch.stack(norms)


def _train_ddp(model, group, gr, rule: str, clip: bool) -> dict:
    """STEPS steps of DDP with SGD momentum; the step is skipped by ``rule``.

    Rank 1's batch spikes at SPIKE_STEP (its own loss trips the rule, the others' do
    not); with the reduced rule it also holds a NaN at NAN_STEP. (A NaN loss under the
    local rule would put NaN in every replica: DDP averages its gradient into all.)
    """
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    skipped = []
    for step in range(STEPS):
        spike = 30.0 if (step == SPIKE_STEP and gr == 1) else 1.0
        x, y = batch(gr, step, spike)
        if step == NAN_STEP and gr == 1 and rule == "reduced":
            x = x.clone()
            x[0, 0] = math.nan
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        keep = torch.isfinite(loss) & (loss < 20.0)  # a loss-based skip rule
        if rule == "reduced":
            keep = all_reduce_keep(keep, group)
        if clip:
            gradlab.clip_grad_norm_(ddp.parameters(), 0.5)
        if rule == "none" or bool(keep):
            opt.step()
        skipped.append(not (rule == "none" or bool(keep)))
    params = [p.detach() for p in ddp.module.parameters()]
    return {
        "params": digest(params),
        "state": digest(_state(opt)),
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
        "skipped": skipped,
    }


def scenario_ddp(ctx: Ctx) -> dict:
    """DDP: clipping keeps replicas identical; a local skip rule does not."""
    out = {}
    for size in SIZES:
        group, gr = ctx.group(size), ctx.grank(size)
        # clip only (no NaN batch: DDP averages it into every rank's gradient)
        ddp = nn.parallel.DistributedDataParallel(make_mlp(0), process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        norms = []
        for step in range(STEPS):
            x, y = batch(gr, step)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            norms.append(gradlab.clip_grad_norm_(ddp.parameters(), 0.1))
            opt.step()
        out["clip", size] = {
            "values": [q.detach().clone() for q in ddp.module.parameters()],
            "params": digest(ddp.module.parameters()),
            "state": digest(_state(opt)),
            "norms": torch.stack(norms),
        }
        for rule in ("local", "reduced"):
            out[rule, size] = _train_ddp(make_mlp(0), group, gr, rule, clip=True)
    return out


#: FSDP2 models: "even" shards evenly over 2 and 4 ranks; "uneven" leaves rank 3 of 4
#: an empty shard of the last bias (3 rows), where torch's inf-norm raises on that rank.
FSDP_SHAPES = {"even": (8, 4), "uneven": (7, 3)}


def _fsdp_model(mesh, shape: str):
    from torch.distributed.fsdp import fully_shard

    model = make_mlp(1, *FSDP_SHAPES[shape])
    reference = copy.deepcopy(model).double()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, reference


def _waited(dtensor) -> torch.Tensor:
    """``full_tensor()`` as a plain tensor whose collective has completed."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    full = dtensor.full_tensor()
    return full.wait() if isinstance(full, AsyncCollectiveTensor) else full


def scenario_fsdp(ctx: Ctx) -> dict:
    """FSDP2 (fully_shard) on gloo: shard norms, the global norm, clip, NaN on one rank."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    out = {}
    for size in SIZES:
        group, gr = ctx.group(size), ctx.grank(size)
        if size == WORLD:
            mesh = init_device_mesh("cpu", (WORLD,))
        else:
            mesh = DeviceMesh.from_group(group, "cpu")
        for shape in FSDP_SHAPES:
            model, reference = _fsdp_model(mesh, shape)
            x, y = batch(gr, out_features=FSDP_SHAPES[shape][1])
            nn.functional.mse_loss(model(x), y).backward()
            # The reference: one process, float64, the mean of every rank's loss.
            batches = [batch(r, out_features=FSDP_SHAPES[shape][1]) for r in range(size)]
            losses = [nn.functional.mse_loss(reference(a.double()), b.double()) for a, b in batches]
            (sum(losses) / size).backward()
            ref_grads = [p.grad for p in reference.parameters()]
            grads = [p.grad for p in model.parameters()]
            out["placements", size, shape] = [str(g.placements) for g in grads]
            out["numel", size, shape] = [g.to_local().numel() for g in grads]
            for p in NORM_TYPES:
                local = [g.to_local() for g in grads]
                out["local", size, shape, p] = gradlab.get_total_norm(local, p)
                out["gradlab", size, shape, p] = gradlab.get_total_norm(grads, p)
                if shape == "even" or p != math.inf:
                    out["torch", size, shape, p] = _waited(torch.nn.utils.get_total_norm(grads, p))
                out["reference", size, shape, p] = torch.linalg.vector_norm(
                    torch.cat([g.reshape(-1) for g in ref_grads]), p
                )
            ref_norm = float(out["reference", size, shape, 2.0])
            # clip with the global norm, against the float64 reference clip
            norm = gradlab.clip_grad_norm_(model.parameters(), 0.5 * ref_norm)
            coef = min(1.0, 0.5 * ref_norm / (ref_norm + 1e-6))
            out["clip", size, shape] = (
                norm,
                [_waited(p.grad) for p in model.parameters()],
                [g * coef for g in ref_grads],
            )
            # torch's DTensor norm handed to gradlab's second phases
            clipped = out["clip", size, shape][2]
            n1 = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in clipped])))
            coef2 = min(1.0, 0.25 * ref_norm / (n1 + 1e-6))
            torch_norm = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()])
            gradlab.clip_grads_with_norm_(model.parameters(), 0.25 * ref_norm, torch_norm)
            out["with_norm", size, shape] = (
                [_waited(q.grad) for q in model.parameters()],
                [g * coef2 for g in clipped],
            )
            bound = 0.5 * float(torch.cat([g.reshape(-1) for g in clipped]).abs().max()) * coef2
            gradlab.clip_grad_value_(model.parameters(), bound)
            out["value", size, shape] = (
                [_waited(q.grad) for q in model.parameters()],
                [(g * coef2).clamp(-bound, bound) for g in clipped],
            )
            torch_norm = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()])
            gradlab.grad_ignore_with_norm_(model.parameters(), 0.0, torch_norm)
            out["ignore_with_norm", size, shape] = all(
                bool((q.grad.to_local() == 0).all()) for q in model.parameters()
            )
            # a NaN in one rank's shard only
            first = next(iter(model.parameters())).grad
            if gr == size - 1:
                first.to_local().view(-1)[0] = math.nan
            grads = [q.grad for q in model.parameters()]
            for p in (2.0, math.inf):
                out["nan_gradlab", size, shape, p] = gradlab.get_total_norm(grads, p)
                if shape == "even":
                    torch_norm = torch.nn.utils.get_total_norm(grads, p)
                    out["nan_torch", size, shape, p] = _waited(torch_norm)
            gradlab.grad_ignore_norm_(model.parameters(), 1e30, math.inf)
            out["nan_ignored", size, shape] = all(bool((g.to_local() == 0).all()) for g in grads)
    return out


def scenario_hsdp(ctx: Ctx) -> dict:
    """HSDP: a 2 x 2 mesh, (Replicate, Shard(0)): only the shard dim is summed."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, reference = _fsdp_model(mesh, "uneven")
    x, y = batch(ctx.rank)
    nn.functional.mse_loss(model(x), y).backward()
    losses = [
        nn.functional.mse_loss(reference(a.double()), b.double())
        for a, b in map(batch, range(WORLD))
    ]
    (sum(losses) / WORLD).backward()
    ref = torch.cat([q.grad.reshape(-1) for q in reference.parameters()])
    grads = [q.grad for q in model.parameters()]
    out = {"placements": [str(g.placements) for g in grads]}
    for p in (1.0, 2.0, math.inf, 100.0):
        out["gradlab", p] = gradlab.get_total_norm(grads, p)
        out["reference", p] = torch.linalg.vector_norm(ref, p)
        out["torch", p] = _waited(torch.nn.utils.get_total_norm(grads, p))
    return out


def scenario_steps(ctx: Ctx) -> dict:
    """Hand-sharded w and replicated b, Adam, a spike and a NaN on one rank's shard."""
    out = {}
    for size in SIZES:
        group, gr = ctx.group(size), ctx.grank(size)
        for rule in ("reduced", "local"):
            w = nn.Parameter(torch.tensor_split(torch.linspace(-1, 1, 12), size)[gr].clone())
            b = nn.Parameter(torch.ones(3))
            opt = _adam([w, b])
            for step in range(STEPS):
                gw, gb, _ = step_grads(step, size)
                w.grad = torch.tensor_split(gw, size)[gr].clone()
                b.grad = gb.clone()
                if rule == "reduced":
                    norm = gradlab.get_total_norm([w.grad], process_group=group)
                    gradlab.grad_ignore_with_norm_([w, b], MAX_NORM, norm)
                else:
                    gradlab.grad_ignore_norm_([w, b], MAX_NORM)
                opt.step()
            state = _state(opt)  # [w's exp_avg, exp_avg_sq, step, b's ...]
            out[rule, size] = {
                "w": w.detach().clone(),
                "w_state": state[:3],
                "b": digest([b]),
                "b_state": digest(state[3:]),
            }
    return out


# ---------------------------------------------------------------- StepGuard(process_group)

GUARD_STEPS = 12
GUARD_SPIKE_STEP, GUARD_NAN_STEP = 8, 10
#: How each StepGuard run steps: (optimizer factory, sync).
GUARD_OPTIMIZERS = {
    "fused": (lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True), False),
    "snapshot": (lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False), False),
    "sync": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), True),
}


def _policy_digest(state: dict) -> str:
    tensors = []
    for key in ("threshold", "loss_threshold"):
        tensors.extend(v for _, v in sorted(state[key]["state"].items()))
    assert tensors, "no policy state to compare"
    return digest(tensors)


def _guarded_ddp(group, gr, optimizer: str, reduced: bool) -> dict:
    """DDP under a StepGuard with a ZClip norm policy and a SigmaSkip loss rule.

    Rank 1's batch spikes at GUARD_SPIKE_STEP (only its own loss trips SigmaSkip) and
    holds a NaN at GUARD_NAN_STEP.
    """
    make_opt, sync = GUARD_OPTIMIZERS[optimizer]
    ddp = nn.parallel.DistributedDataParallel(make_mlp(0), process_group=group)
    guard = gradlab.StepGuard(
        make_opt(ddp.parameters()),
        mode="clip",
        threshold=gradlab.ZClip(warmup=3),
        loss_threshold=gradlab.SigmaSkip(k=3.0, window=16, min_count=4),
        sync=sync,
        process_group=group if reduced else None,
        grads="replicated" if reduced else None,
    )
    decisions, reads = [], []
    for step in range(GUARD_STEPS):
        spike = 30.0 if (step == GUARD_SPIKE_STEP and gr == 1) else 1.0
        x, y = batch(gr, step, spike)
        if step == GUARD_NAN_STEP and gr == 1:
            x = x.clone()
            x[0, 0] = math.nan
        guard.optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        with HostReadCounter() as counter:
            record = guard.step(loss=loss.detach())
        reads.append(counter.count)
        decisions.append(record.decision)
    params = [p.detach() for p in ddp.module.parameters()]
    return {
        "params": digest(params),
        "state": digest(_state(guard.optimizer)),
        "policies": _policy_digest(guard.state_dict()),
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
        "decisions": decisions,
        "reads": reads,
    }


def guard_sharded_reference(size: int) -> dict:
    """One process, the whole w, torch Adam: a step is taken when the float64 norm of
    w's whole gradient is within MAX_NORM by the guard's rule, else not at all."""
    w = nn.Parameter(torch.linspace(-1, 1, 12))
    opt = torch.optim.Adam([w], lr=0.1, foreach=False)
    taken = []
    for step in range(STEPS):
        gw, _, _ = step_grads(step, size)
        norm = float(torch.linalg.vector_norm(gw.double()))
        keep = math.isfinite(norm) and MAX_NORM / (norm + 1e-6) >= 1.0
        if keep:
            w.grad = gw.clone()
            opt.step()
        taken.append(keep)
    return {"w": w.detach().clone(), "state": _state(opt), "taken": taken}


def scenario_guard(ctx: Ctx) -> dict:
    """StepGuard(process_group=): DDP with policies, and a hand-sharded parameter."""
    out = {}
    for size in SIZES:
        group, gr = ctx.group(size), ctx.grank(size)
        for optimizer in GUARD_OPTIMIZERS:
            for reduced in (True, False):
                out["ddp", size, optimizer, reduced] = _guarded_ddp(group, gr, optimizer, reduced)
        w = nn.Parameter(torch.tensor_split(torch.linspace(-1, 1, 12), size)[gr].clone())
        guard = gradlab.StepGuard(
            torch.optim.Adam([w], lr=0.1, foreach=False),
            mode="skip",
            threshold=MAX_NORM,
            sync=False,
            process_group=group,
            grads="sharded",
        )
        decisions = []
        for step in range(STEPS):
            gw, _, _ = step_grads(step, size)
            w.grad = torch.tensor_split(gw, size)[gr].clone()
            decisions.append(guard.step().decision)
        out["sharded", size] = {
            "w": w.detach().clone(),
            "state": _state(guard.optimizer),
            "decisions": decisions,
        }
    return out


SCENARIOS = {
    "norms": scenario_norms,
    "nonfinite": scenario_nonfinite,
    "ddp": scenario_ddp,
    "fsdp": scenario_fsdp,
    "hsdp": scenario_hsdp,
    "steps": scenario_steps,
    "guard": scenario_guard,
}


# -------------------------------------------------------------------------- worker


def worker(rank: int, init_file: str, out_dir: str, names: list[str], module: str) -> None:
    """One rank: join the world, run each scenario of ``module``, save after each, leave."""
    scenarios = importlib.import_module(module)
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
        ctx = getattr(scenarios, "Ctx", Ctx)(rank)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        ctx.pair = pairs[rank // 2]
        for name in names:
            try:
                results[name] = scenarios.SCENARIOS[name](ctx)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            torch.save(results, path + ".tmp")
            os.replace(path + ".tmp", path)
            dist.barrier()  # a rank that failed early waits here, not in the next scenario
    finally:
        dist.destroy_process_group()


def start(
    out_dir: str,
    names: list[str] | None = None,
    timeout_s: float = 240.0,
    module: str = "dist_workers",
) -> list[dict]:
    """Start the world, wait for it (killing it after ``timeout_s``), return each rank's.

    ``module`` names the module of scenarios (a dict ``SCENARIOS``, and optionally a
    ``Ctx`` class) that every rank imports; ``names`` picks some of them.
    """
    import torch.multiprocessing as mp

    names = list(importlib.import_module(module).SCENARIOS) if names is None else names
    init_file = os.path.join(out_dir, "init")
    if os.path.exists(init_file):  # a stale rendezvous file would make the ranks wait
        os.remove(init_file)
    context = mp.start_processes(
        worker,
        args=(init_file, out_dir, names, module),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    error = None
    try:
        import time

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
    results = start(sys.argv[1], sys.argv[2:] or None)
    for name in results[0]:
        value = results[0][name]
        if isinstance(value, dict) and "error" in value:
            print(name, value["error"])
        else:
            print(name, "ok" if name != "__error__" else value)
