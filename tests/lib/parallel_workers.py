"""The worker side of test_distributed_parallel.py: TP, FSDP x TP, PP and EP on gloo.

The world of ``dist_workers.WORLD`` (4) ranks is started once for the module by
``dist_workers.start(..., module="parallel_workers")``. Inside it:

* ``mesh1``, a 1-D mesh of the 4 ranks, and ``mesh2``, a 2 x 2 mesh whose dim 0
  ("outer") groups ranks {0, 2} and {1, 3} and whose dim 1 ("inner") groups {0, 1} and
  {2, 3}. A rank's coordinate is (rank // 2, rank % 2). Each scenario reads the dims as
  it needs: (dp, tp), (pp, tp), (pp, ep) or (edp, ep).

Each rank saves what it computed with gradlab, and the full gradients as torch gathers
them (``DTensor.full_tensor()``) or as the test can rebuild them from the seeds here;
the tests compute the reference norms from those in float64, independently of gradlab.
"""

from __future__ import annotations

import copy
import math

import dist_workers as dw
import torch
import torch.distributed as dist
from torch import nn

import gradlab
from gradlab.distributed import total_norm
from gradlab.sync import HostReadCounter

WORLD = dw.WORLD
#: p = 8 takes the max-scaled path (above 4); 1, 2 and 3 the torch path.
P_VALUES = (1.0, 2.0, 3.0, 8.0, math.inf)
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
BAD_P = (2.0, 8.0, math.inf)

#: Synthetic DTensor gradients: case -> [(mesh, shape, placements)]. "S0"/"S1" Shard,
#: "R" Replicate, "P" Partial (the rank's addend is a share of the value). "tp" is the
#: inner dim of mesh2 (two groups of 2), "world" mesh1, "2d" mesh2. (3,) and (1,) leave
#: empty shards; "meshes" puts DTensors of three meshes in one call.
CASES = {
    "tp": [
        ("tp", (6, 4), ("S0",)),
        ("tp", (4, 6), ("S1",)),
        ("tp", (5,), ("R",)),
        ("tp", (4,), ("P",)),
        ("tp", (3, 2), ("S0",)),
        ("tp", (1,), ("S0",)),
    ],
    "world": [
        ("world", (6, 4), ("S0",)),
        ("world", (3,), ("S0",)),
        ("world", (4, 8), ("S1",)),
        ("world", (5,), ("R",)),
        ("world", (7,), ("P",)),
    ],
    "2d": [
        ("2d", (8, 4), ("S0", "S1")),
        ("2d", (6, 3), ("S0", "R")),
        ("2d", (4, 6), ("R", "S1")),
        ("2d", (5,), ("R", "R")),
        ("2d", (4,), ("S0", "P")),
        ("2d", (6,), ("P", "R")),
    ],
    "meshes": [
        ("2d", (8, 4), ("R", "S0")),
        ("world", (8, 4), ("S0",)),
        ("tp", (5,), ("R",)),
        ("tp", (4, 6), ("S1",)),
    ],
}
#: Per case, the index of a sharded tensor with an entry on every rank, and of a Partial
#: one (None: no Partial).
BAD_SLOTS = {"tp": (0, 3), "world": (2, 4), "2d": (0, 4), "meshes": (1, None)}


class Ctx(dw.Ctx):
    """dw.Ctx with the two meshes, made once for the world."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh1 = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
        self.mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))

    @property
    def outer(self) -> int:
        return self.rank // 2

    @property
    def inner(self) -> int:
        return self.rank % 2

    def mesh(self, name: str):
        return {"tp": self.mesh2["inner"], "world": self.mesh1, "2d": self.mesh2}[name]


# --------------------------------------------------------------------- shared data


def full(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A seeded tensor, the same on every rank (made in float64, then rounded)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 2.0).to(dtype)


def _placement(code: str):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {"R": Replicate(), "P": Partial(), "S0": Shard(0), "S1": Shard(1)}[code]


def make_grad(value: torch.Tensor, mesh, codes: tuple[str, ...]):
    """``value`` laid out on ``mesh``; on a Partial dim, rank c of k holds the addend
    value * (c + 1) / (k (k + 1) / 2), so that no rank's addend is the whole."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    placements = [_placement(c) for c in codes]
    base = [Replicate() if p.is_partial() else p for p in placements]
    local = distribute_tensor(value, mesh, base).to_local()
    for dim, p in enumerate(placements):
        if p.is_partial():
            k, c = mesh.size(dim), mesh.get_local_rank(dim)
            local = local * ((c + 1) / (k * (k + 1) / 2))
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=value.shape, stride=value.stride()
    )


def with_grads(grads: list) -> list[nn.Parameter]:
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros_like(g))
        p.grad = _copy(g) if gradlab.distributed.is_dtensor(g) else g.clone()
        params.append(p)
    return params


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (torch's own gather), a plain tensor as it is."""
    if not gradlab.distributed.is_dtensor(t):
        return t.detach().clone()
    return dw._waited(t).clone()  # of a Replicate DTensor, the local tensor itself


def _copy(t):
    """A copy of DTensor ``t`` with the same placements and local pieces (a DTensor's
    own clone() may reduce a Partial tensor to a Replicate one)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        t.to_local().clone(),
        t.device_mesh,
        t.placements,
        run_check=False,
        shape=t.shape,
        stride=t.stride(),
    )


def _case_grads(ctx: Ctx, case: str, dtype: torch.dtype) -> list:
    return [
        make_grad(full(shape, 100 * i + 7, dtype), ctx.mesh(mesh), codes)
        for i, (mesh, shape, codes) in enumerate(CASES[case])
    ]


def _torch_norm(grads: list, p: float):
    """torch's DTensor norm, or None where torch refuses (mixed meshes, empty shards)."""
    try:
        norm = torch.nn.utils.get_total_norm(grads, p)
    except RuntimeError:
        return None
    return dw._waited(norm) if gradlab.distributed.is_dtensor(norm) else norm


# ----------------------------------------------------------------------- scenarios


def scenario_placements(ctx: Ctx) -> dict:
    """Synthetic DTensor gradients of every placement: norms, controls, NaN, clip."""
    out: dict = {}
    world = dist.group.WORLD
    for case in CASES:
        for dtype in DTYPES:
            grads = _case_grads(ctx, case, dtype)
            out["full", case, str(dtype)] = [_gathered(g) for g in grads]
            out["placements", case] = [str(g.placements) for g in grads]
            for p in P_VALUES:
                out["gradlab", case, str(dtype), p] = gradlab.get_total_norm(grads, p)
                if dtype == torch.float32:
                    # The control: every rank's local values summed over the world, as a
                    # norm blind to placements would; replicas and addends count wrong.
                    pieces = gradlab.distributed.local_tensors(grads)
                    out["naive", case, p] = gradlab.get_total_norm(pieces, p, process_group=world)
                    if p != math.inf:
                        out["torch", case, p] = _torch_norm(grads, p)
        # A NaN or an inf in one rank's shard, then in one rank's Partial addend.
        shard_slot, partial_slot = BAD_SLOTS[case]
        base = _case_grads(ctx, case, torch.float32)
        for slot in (shard_slot, partial_slot):
            if slot is None:
                continue
            for bad in range(WORLD):
                for value in (math.nan, math.inf):
                    grads = [_copy(g) for g in base]
                    local = grads[slot].to_local()
                    if ctx.rank == bad and local.numel():
                        local.view(-1)[0] = value
                    for p in BAD_P:
                        norm = gradlab.get_total_norm(grads, p)
                        out["bad", case, slot, bad, str(value), p] = float(norm)
        # clip and ignore by the global norm, the largest entry for the value rule
        grads = base
        whole = torch.cat([_gathered(g).reshape(-1).double() for g in grads])
        ref, peak = float(torch.linalg.vector_norm(whole)), float(whole.abs().max())
        params = with_grads(grads)
        out["clip_placements", case] = [str(q.grad.placements) for q in params]
        norm = gradlab.clip_grad_norm_(params, 0.5 * ref)
        out["clip", case] = (norm, [_gathered(q.grad) for q in params])
        for name, factor in (("ignore_over", 0.95), ("ignore_under", 1.05)):
            params = with_grads(grads)
            gradlab.grad_ignore_norm_(params, factor * ref)
            out[name, case] = [_gathered(q.grad) for q in params]
        params = with_grads(grads)
        largest = gradlab.grad_ignore_value_(params, peak)
        out["value", case] = (largest, [_gathered(q.grad) for q in params])
    grads = _case_grads(ctx, "2d", torch.float32)
    with HostReadCounter() as reads:
        for p in (2.0, 8.0, math.inf):
            gradlab.get_total_norm(grads, p)
    out["host_reads"] = reads.operations
    return out


def tp_model(seed: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.LayerNorm(8), nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8), nn.LayerNorm(8)
    )


def tp_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + index)
    return torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, 8, generator=gen)


def _parallelize(model: nn.Module, tp_mesh) -> nn.Module:
    """Megatron-style TP with sequence parallelism: Colwise, Rowwise, SequenceParallel."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "0": SequenceParallel(),
        "1": ColwiseParallel(input_layouts=Shard(1)),
        "3": RowwiseParallel(output_layouts=Shard(1)),
        "4": SequenceParallel(),
    }
    return parallelize_module(model, tp_mesh, plan)


def _model_run(model: nn.Module, reference: nn.Module, batches: list, mine: int, tp_mesh) -> dict:
    """Backward on this rank's batch; the reference on the mean of every batch's loss."""
    x, y = batches[mine]
    # SequenceParallel takes the input sharded along the sequence (dim 1).
    out = model(x.chunk(tp_mesh.size(), dim=1)[tp_mesh.get_local_rank()])
    nn.functional.mse_loss(out.full_tensor(), y).backward()
    losses = [nn.functional.mse_loss(reference(a.double()), b.double()) for a, b in batches]
    (sum(losses) / len(losses)).backward()
    grads = [q.grad for q in model.parameters()]
    res: dict = {
        "placements": [str(g.placements) for g in grads],
        "reference": [q.grad.detach().clone() for q in reference.parameters()],
        "gathered": [_gathered(g) for g in grads],
    }
    for p in P_VALUES:
        res["gradlab", p] = gradlab.get_total_norm(grads, p)
        if p != math.inf:
            res["torch", p] = _torch_norm(grads, p)
    ref = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in res["reference"]])))
    res["clip"] = gradlab.clip_grad_norm_(model.parameters(), 0.5 * ref)
    res["clipped"] = [_gathered(q.grad) for q in model.parameters()]
    return res


def scenario_tp(ctx: Ctx) -> dict:
    """A real tensor-parallel model (parallelize_module) over 2 and over 4 ranks."""
    out = {}
    for size, tp_mesh in ((2, ctx.mesh2["inner"]), (WORLD, ctx.mesh1)):
        model = tp_model()
        reference = copy.deepcopy(model).double()
        _parallelize(model, tp_mesh)
        # Every TP rank sees the same batch: the batch of its data-parallel index (0).
        out[size] = _model_run(model, reference, [tp_batch(0)], 0, tp_mesh)
    return out


def scenario_fsdp_tp(ctx: Ctx) -> dict:
    """FSDP2 x TP on the 2 x 2 mesh (dp = outer, tp = inner): 2-D placements."""
    from torch.distributed.fsdp import fully_shard

    model = tp_model()
    reference = copy.deepcopy(model).double()
    _parallelize(model, ctx.mesh2["inner"])
    fully_shard(model, mesh=ctx.mesh2["outer"])
    batches = [tp_batch(i) for i in range(2)]  # one per data-parallel index
    return _model_run(model, reference, batches, ctx.outer, ctx.mesh2["inner"])


#: Pipeline stages on mesh2 (pp = outer, tp = inner): different layers, shapes and
#: placements per stage, on the stage's TP mesh.
STAGES = {
    0: [((6, 4), ("S0",)), ((5,), ("R",)), ((4,), ("P",))],
    1: [((4, 6), ("S1",)), ((3,), ("S0",)), ((2, 3), ("R",)), ((8,), ("S0",))],
}


def stage_grads(ctx: Ctx, stage: int, dtype: torch.dtype = torch.float32) -> list:
    tp_mesh = ctx.mesh2["inner"]
    return [
        make_grad(full(shape, 1000 * stage + i, dtype), tp_mesh, codes)
        for i, (shape, codes) in enumerate(STAGES[stage])
    ]


def scenario_pp(ctx: Ctx) -> dict:
    """Pipeline stages: norms summed over the PP group, DTensor and Megatron-style."""
    out: dict = {}
    pp, tp = ctx.mesh2.get_group("outer"), ctx.mesh2.get_group("inner")
    stage = ctx.outer
    out["stage"] = stage
    grads = stage_grads(ctx, stage)
    out["full"] = [_gathered(g) for g in grads]
    # Megatron-style plain tensors: the shards, and one copy per TP rank of the rest.
    codes = [c for _, c in STAGES[stage]]
    shards = [g.to_local() for g, c in zip(grads, codes, strict=True) if c[0].startswith("S")]
    copies = [
        gradlab.distributed.split_dtensors([g])[0][0]  # a Partial is summed first
        for g, c in zip(grads, codes, strict=True)
        if not c[0].startswith("S")
    ]
    world = dist.group.WORLD
    for p in P_VALUES:
        out["gradlab", p] = gradlab.get_total_norm(grads, p, process_group=pp)
        out["stage_only", p] = gradlab.get_total_norm(grads, p)
        out["parts", p] = total_norm([(shards, [tp, pp]), (copies, pp)], p)
        counted = shards + (copies if ctx.inner == 0 else [])  # Megatron's TP-rank-0 rule
        out["megatron", p] = total_norm([(counted, world)], p)
        out["double", p] = gradlab.get_total_norm(shards + copies, p, process_group=world)
    # A group of the DTensors' own mesh, or two overlapping groups in one part, would
    # count pieces twice: refused, before any gradient changes.
    params = with_grads(grads)
    try:
        gradlab.clip_grad_norm_(params, 1e-3, process_group=tp)
    except ValueError as err:
        out["refused"] = str(err)
    out["refused_untouched"] = [_gathered(q.grad) for q in params]
    try:
        total_norm([(shards, [world, tp])])
    except ValueError as err:
        out["refused_parts"] = str(err)
    # What a StepGuard over a group adds to the DTensors' own reduction.
    beyond = gradlab.distributed.group_beyond_meshes
    out["beyond_pp"], out["beyond_tp"] = beyond(grads, pp) is pp, beyond(grads, tp) is None
    try:
        beyond(grads, world)
        out["beyond_world"] = "accepted"
    except ValueError as err:
        out["beyond_world"] = str(err)
    params = with_grads(stage_grads(ctx, stage))
    guard = gradlab.StepGuard(
        torch.optim.SGD(params, lr=0.0), threshold=1e9, process_group=pp, grads="sharded"
    )
    out["guard_norm"] = guard.step().total_norm
    for value in (math.nan, math.inf):
        bad = stage_grads(ctx, stage)
        if ctx.rank == WORLD - 1:
            bad[0].to_local().view(-1)[0] = value
        for p in BAD_P:
            out["bad", str(value), p] = float(gradlab.get_total_norm(bad, p, process_group=pp))
    ref = float(out["gradlab", 2.0])
    params = with_grads(grads)
    out["clip"] = gradlab.clip_grad_norm_(params, 0.5 * ref, process_group=pp)
    out["clipped"] = [_gathered(q.grad) for q in params]
    # Over the stage's own norm, under the global one: alone a stage would keep.
    threshold = 0.5 * (float(out["stage_only", 2.0]) + ref)
    params = with_grads(grads)
    out["ignore"] = gradlab.grad_ignore_norm_(params, threshold, process_group=pp)
    out["ignored"] = [_gathered(q.grad) for q in params]
    return out


#: Experts: E weights (3, 5) and biases (5,), split over the EP group in order; the
#: dense tensors are the same on every rank (data-parallel replicas).
EXPERTS = 4
DENSE_SHAPES = ((5, 4), (4,))


def dense_grads(seed: int = 0) -> list[torch.Tensor]:
    return [full(s, 2000 + seed * 10 + i) for i, s in enumerate(DENSE_SHAPES)]


def expert_grads(seed: int = 0) -> list[torch.Tensor]:
    """[w_0, b_0, w_1, b_1, ...]: every expert's gradient."""
    out = []
    for e in range(EXPERTS):
        out += [full((3, 5), 3000 + seed * 100 + 2 * e), full((5,), 3001 + seed * 100 + 2 * e)]
    return out


def my_experts(grads: list[torch.Tensor], size: int, index: int) -> list[torch.Tensor]:
    per = EXPERTS // size
    return [g.clone() for g in grads[2 * per * index : 2 * per * (index + 1)]]


def scenario_ep(ctx: Ctx) -> dict:
    """Experts split over an EP group, dense replicated: total_norm's parts."""
    out: dict = {}
    for size in dw.SIZES:
        group, gr = ctx.group(size), ctx.grank(size)
        dense, experts = dense_grads(), my_experts(expert_grads(), size, gr)
        for p in P_VALUES:
            out["parts", size, p] = total_norm([(dense, None), (experts, group)], p)
            out["double", size, p] = gradlab.get_total_norm(dense + experts, p, process_group=group)
        for bad in range(size):
            for value in (math.nan, math.inf):
                hurt = [g.clone() for g in experts]
                if gr == bad:
                    hurt[-1].view(-1)[0] = value
                for p in BAD_P:
                    norm = total_norm([(dense, None), (hurt, group)], p)
                    out["bad", size, bad, str(value), p] = float(norm)
        ref = float(out["parts", size, 2.0])
        params = with_grads(dense + experts)
        grads = [q.grad for q in params]
        norm = total_norm([(grads[: len(dense)], None), (grads[len(dense) :], group)])
        gradlab.clip_grads_with_norm_(params, 0.5 * ref, norm)
        out["clip", size] = (norm, [q.grad for q in params])
        with HostReadCounter() as reads:
            total_norm([(dense, None), (experts, group)], 8.0)
        out["host_reads", size] = reads.operations
    # torchtitan style: experts one DTensor (E, 3, 5) on (edp, ep) = mesh2, replicated
    # over edp (outer) and sharded over ep (inner); dense FSDP-sharded on the 1-D mesh.
    stacked = torch.stack(expert_grads()[0::2])
    dtensors = [
        make_grad(dense_grads()[0], ctx.mesh1, ("S0",)),
        make_grad(dense_grads()[1], ctx.mesh1, ("S0",)),
        make_grad(stacked, ctx.mesh2, ("R", "S0")),
    ]
    out["meshes_full"] = [_gathered(g) for g in dtensors]
    for p in P_VALUES:
        out["meshes", p] = gradlab.get_total_norm(dtensors, p)
    out["meshes_torch"] = _torch_norm(dtensors, 2.0)
    # EP x PP on mesh2 (pp = outer, ep = inner): each stage its own dense and experts.
    pp, ep = ctx.mesh2.get_group("outer"), ctx.mesh2.get_group("inner")
    stage = ctx.outer
    dense, experts = dense_grads(stage), my_experts(expert_grads(stage), 2, ctx.inner)
    for p in P_VALUES:
        out["ep_pp", p] = total_norm([(dense, pp), (experts, [ep, pp])], p)
        out["ep_pp_double", p] = total_norm([(dense + experts, [ep, pp])], p)
    return out


SCENARIOS = {
    "placements": scenario_placements,
    "tp": scenario_tp,
    "fsdp_tp": scenario_fsdp_tp,
    "pp": scenario_pp,
    "ep": scenario_ep,
}
