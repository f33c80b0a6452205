r"""Norms and decisions over a process group, and DTensor gradients.

A p-norm of tensors split across ranks is the p-norm of the per-rank norms
:math:`n_r`, so it needs one collective per group, with no host read:

* finite p up to 4: :math:`(\sum_r n_r^p)^{1/p}`, one all-reduce SUM, what DTensor's
  ``_NormPartial`` does (for DTensors it is applied to the vector of per-tensor norms,
  as ``torch.nn.utils.get_total_norm`` does, which gives torch's bits);
* larger finite p: :math:`M\,(\sum_r (n_r/M)^p)^{1/p}` with :math:`M = \max_r n_r`,
  an all-reduce MAX and then a SUM, so that :math:`n_r^p` neither overflows nor
  underflows (with p = 100, ``1e2 ** 100`` is beyond even float64);
* the inf-norm: :math:`\max_r n_r`, an all-reduce MAX.

Every MAX here carries a separate NaN flag: gloo's MAX and MIN drop a NaN depending on
which rank holds it (a NaN on rank 0 wins, a NaN on rank 1 loses to 1.0), while a SUM
always propagates it. The value and its flag travel in one 2-element tensor, and the
result is NaN wherever any rank's value was.

Every result of a collective has the same bits on every rank, and everything computed
from it afterwards is computed alike, so every rank takes the same decision.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from gradlab._common import PLAIN_TYPES

__all__ = [
    "all_reduce_decision",
    "all_reduce_keep",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_norm",
    "is_dtensor",
    "local_tensors",
    "split_dtensors",
]


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a :class:`torch.distributed.tensor.DTensor` (imported lazily)."""
    if type(t) in PLAIN_TYPES:  # the common case, and the one torch.compile sees
        return False
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensors(tensors: list[Tensor]) -> list[Tensor]:
    """Each DTensor replaced by its local shard (a view: in-place ops write through)."""
    if all(type(t) in PLAIN_TYPES for t in tensors):
        return tensors
    return [t.to_local() if is_dtensor(t) else t for t in tensors]


def _shard_dims(t: Tensor) -> tuple[int, ...]:
    """The mesh dims over which DTensor ``t`` is sharded; Partial is refused."""
    dims = []
    for mesh_dim, placement in enumerate(t.placements):
        if placement.is_partial():
            raise ValueError(
                "gradients with a Partial placement are not reduced yet; redistribute them "
                f"to Shard or Replicate first (got placements {t.placements})"
            )
        if placement.is_shard():
            dims.append(mesh_dim)
    return tuple(dims)


def split_dtensors(tensors: list[Tensor]) -> tuple[list[Tensor], list[tuple[list, list[Tensor]]]]:
    """(plain tensors, [(process groups, local shards)] per DTensor mesh and sharding).

    DTensors on the same mesh and sharded over the same mesh dims form one domain,
    whose norm is reduced over the groups of those mesh dims (replicated mesh dims
    hold copies and are not summed). Domains keep the order of first appearance, so
    every rank issues the same collectives in the same order.
    """
    plain: list[Tensor] = []
    domains: dict[tuple, tuple[list, list[Tensor]]] = {}
    for t in tensors:
        if not is_dtensor(t):
            plain.append(t)
            continue
        dims = _shard_dims(t)
        key = (t.device_mesh, dims)
        if key not in domains:
            domains[key] = ([t.device_mesh.get_group(d) for d in dims], [])
        domains[key][1].append(t.to_local())
    return plain, list(domains.values())


def _all_reduce(t: Tensor, op: str, groups: Sequence) -> Tensor:
    import torch.distributed as dist

    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    for group in groups:
        dist.all_reduce(t, op=reduce_op, group=group)
    return t


def all_reduce_max(value: Tensor, groups: Sequence) -> Tensor:
    """The maximum of a 0-dim floating-point ``value`` over ``groups``, NaN if any is NaN.

    One all-reduce MAX per group of ``[value, isnan(value)]``: the flag restores the NaN
    that gloo's MAX may drop. ``value`` itself is not modified.
    """
    if not groups:
        return value
    packed = torch.stack([value, torch.isnan(value).to(value.dtype)])
    packed = torch.where(torch.isnan(packed), torch.full_like(packed, -math.inf), packed)
    _all_reduce(packed, "max", groups)
    return torch.where(packed[1] > 0, torch.full_like(packed[0], math.nan), packed[0])


def all_reduce_norm(norm: Tensor, p: float, groups: Sequence, scaled: Callable[[float], bool]):
    """The p-norm over ``groups`` of the per-rank norms ``norm``, on the device.

    ``norm`` is 0-dim, or for finite p up to 4 a vector of per-tensor norms (reduced
    entry by entry). ``scaled(p)`` says whether p needs the max-scaled form.
    """
    if not groups:
        return norm
    if p == math.inf:
        return all_reduce_max(norm, groups)
    if scaled(p):
        peak = all_reduce_max(norm, groups)
        finite = torch.isfinite(peak)
        scale = torch.where(finite & (peak > 0), peak, torch.ones_like(peak))
        powers = _all_reduce(torch.pow(norm / scale, p), "sum", groups)
        return torch.where(finite, torch.pow(powers, 1.0 / p) * scale, peak)
    # The form of DTensor's _NormPartial, so an FSDP2 norm gets torch's bits.
    powers = _all_reduce(norm**p, "sum", groups)
    return powers ** (1.0 / p)


def all_reduce_keep(keep: Tensor, process_group=None) -> Tensor:
    """``keep`` on every rank of ``process_group`` exactly when it is true on all of them.

    Args:
        keep (Tensor): a 0-dim boolean tensor, this rank's decision (true: keep the step).
        process_group (ProcessGroup, optional): the group to agree over; ``None`` is the
            default (world) group.

    Returns:
        Tensor: a new 0-dim boolean tensor on ``keep``'s device, the same on every rank.

    .. note::
        Issues one all-reduce (an integer MAX, which has no NaN to lose) and no host
        read; call it on every rank of the group, on every step.
    """
    import torch.distributed as dist

    rejected = torch.logical_not(keep).to(torch.int32).reshape(1)
    dist.all_reduce(rejected, op=dist.ReduceOp.MAX, group=process_group)
    return rejected[0] == 0


def all_reduce_decision(code: Tensor, process_group=None) -> Tensor:
    """The largest of the ranks' 0-dim integer decision codes, on every rank.

    With a guard's codes (0 kept, 1 clipped, 2 skipped) the step is skipped if any
    rank skips it and clipped if any clips it. One all-reduce MAX of an integer (no
    NaN to lose), no host read; ``code`` itself is not modified.
    """
    import torch.distributed as dist

    agreed = code.reshape(1).clone()
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=process_group)
    return agreed[0]


def all_reduce_mean(value: Tensor, process_group=None) -> Tensor:
    """The mean over the ranks of a 0-dim ``value`` (summed in float64), on every rank.

    One all-reduce SUM, which propagates a NaN or inf from any rank (a MAX may drop
    a NaN); ``value`` itself is not modified. Used for the loss: the mean of the
    ranks' losses is the loss of the whole (global) batch when the ranks' batches
    have the same size.
    """
    import torch.distributed as dist

    total = value.detach().to(torch.float64).reshape(1).clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=process_group)
    return (total[0] / dist.get_world_size(process_group)).to(value.dtype)
