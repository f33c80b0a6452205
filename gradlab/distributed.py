r"""Norms and decisions across ranks: data, tensor, pipeline and expert parallelism.

The global norm of gradients spread over ranks is one number, the same on every rank, so
that every rank clips by the same coefficient and keeps or skips the same step.
:func:`gradlab.get_total_norm` (and so ``clip_grad_norm_``, ``grad_ignore_norm_`` and
``grad_ignore_value_``) computes it for DTensor gradients and, with ``process_group=``,
for gradients split over a group by hand; :func:`total_norm` adds parts that are split
over different groups (expert parallelism). Both are one computation, with no host read.

**Which entries each rank counts.** The global norm must count every entry of the
model's gradient exactly once. A rank counts its local values, and then:

* a **DTensor** gradient is summed over each mesh dim on which it is sharded
  (``Shard``, and FSDP2 x TP's ``_StridedShard``), and not over a ``Replicate`` dim,
  which holds copies: a tensor-parallel LayerNorm weight or row-parallel bias
  (``Replicate()`` on the TP mesh) is counted once, and a 2-D placement such as
  ``(Shard(0), Replicate())`` (FSDP x TP, or HSDP's ``(Replicate(), Shard(0))``) is
  summed over the sharded dim only. A ``Partial`` dim (the LayerNorm weights under
  ``SequenceParallel``) holds addends of the gradient: they are all-reduced first, as
  torch's own DTensor norm does (a collective of that gradient's size);
* a **plain** tensor is counted as it is on this rank;
* then the norm of all of it is summed over ``process_group``, or over each of a part's
  groups (:func:`total_norm`): groups whose ranks hold different pieces (pipeline
  stages, hand-sharded tensors, expert-parallel ranks). Ranks that hold copies (data
  parallel replicas) must not be in them.

The recipes, each giving every rank the global norm:

================================  ============================================================
layout                            call
================================  ============================================================
DDP (replicated gradients)        ``get_total_norm(grads)``
FSDP2, HSDP, TP, FSDP2 x TP       ``get_total_norm(grads)`` (DTensors: reduced over their mesh)
+ pipeline stages (torchtitan)    ``get_total_norm(grads, process_group=pp_mesh.get_group())``
+ experts on their own mesh       the same: each DTensor is reduced over its own mesh
hand-sharded over ``g``           ``get_total_norm(shards, process_group=g)``
Megatron-style plain tensors      ``total_norm([(sharded, [tp, pp]), (replicated, pp),``
                                  ``(experts, [ep, pp])])``
================================  ============================================================

Megatron-LM counts the same entries its own way (``megatron/core/optimizer/clip_grads.py``,
``get_grad_norm_fp32``, fed by ``_filter_grads_for_norm``): a parameter is skipped where it
is shared (tied embeddings on the last stage) or where it is a tensor-parallel duplicate on
a TP rank other than 0 (``param_is_not_tensor_parallel_duplicate``), the rest are summed
over the model-parallel group, and the expert parameters over the expert-model-parallel
group by their own optimizer, the two norms being combined after. :func:`total_norm` with
``(replicated, pp)`` counts those duplicates once without a rank test, and Megatron's single
reduction is ``total_norm([(counted_here, model_parallel_group)])``. torchtitan
(``torchtitan/distributed/utils.py``, ``clip_grad_norm_``) reduces DTensor norms over their
meshes, splits expert and dense parameters because ``torch.nn.utils.get_total_norm`` cannot
stack norms from two meshes, and sums the result over ``pp_mesh``; gradlab's DTensor
reduction takes several meshes in one call.

**The reductions.** With :math:`n_r` this rank's norm, one collective per group, on the
device:

* finite p up to 4: :math:`(\sum_r n_r^p)^{1/p}`, one all-reduce SUM, the form of
  DTensor's ``_NormPartial`` (for DTensors it is applied to the vector of per-tensor
  norms, as ``torch.nn.utils.get_total_norm`` does, which gives torch's bits);
* larger finite p: :math:`M\,(\sum_r (n_r/M)^p)^{1/p}` with :math:`M = \max_r n_r`, an
  all-reduce MAX and then a SUM, so that :math:`n_r^p` neither overflows nor underflows
  (``1e2 ** 100`` is beyond even float64);
* the inf-norm: :math:`\max_r n_r`, an all-reduce MAX.

**A NaN-safe maximum.** An all-reduce MAX cannot be trusted with a NaN:

* NCCL reduces float and double with CUDA's ``fmaxf`` and ``fmax``
  (``src/device/reduce_kernel.h``:
  ``SPECIALIZE_REDUCE(FuncMinMax, float, 1, float, fn.isMinNotMax ? fminf(x, y) : fmaxf(x, y))``),
  which return the operand that is not NaN (IEEE 754 maxNum). A NaN held by any one
  rank is lost; only a NaN on every rank survives.
* gloo reduces with ``std::max`` (``gloo/math.h``: ``c[i] = std::max(a[i], b[i])``),
  which keeps its first operand when the comparison with a NaN is false, so the result
  depends on which rank holds the NaN: measured on the CPU, a NaN on rank 0 survives
  and one on rank 1 is lost (``tests/lib/test_distributed.py``).
* A SUM propagates a NaN on both.

So every MAX here (:func:`all_reduce_max`) reduces a NaN flag beside the value, in one
2-entry tensor: the value with NaN replaced by -inf, and 1.0 where it was NaN. A MAX of
numbers that are never NaN is exact on both backends, and the result is NaN wherever
any rank's value was. The keep decisions (:func:`all_reduce_keep`) are integers, with no
NaN to lose.

Every result of a collective has the same bits on every rank of the group, and what is
computed from it afterwards is computed alike, so every rank takes the same decision.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeGuard, Union

import torch
from torch import Tensor

from gradlab._common import (
    PLAIN_TYPES,
    TensorOrTensors,
    as_tensor_list,
    check_flag,
    check_foreach,
    check_norm_type,
    check_process_group,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.tensor import DTensor

__all__ = [
    "ProcessGroups",
    "all_reduce_keep",
    "all_reduce_max",
    "all_reduce_mean",
    "all_reduce_norm",
    "group_beyond_meshes",
    "is_dtensor",
    "local_tensors",
    "refuse_partial",
    "split_dtensors",
    "total_norm",
]

#: One process group, several (reduced over one after the other), or none.
ProcessGroups = Union["ProcessGroup", Sequence["ProcessGroup"], None]


# --------------------------------------------------------------------------- DTensors


def is_dtensor(t: Tensor) -> TypeGuard[DTensor]:
    """Whether ``t`` is a :class:`torch.distributed.tensor.DTensor`.

    Args:
        t (Tensor): any tensor.

    Returns:
        bool: ``True`` for a DTensor. ``torch.distributed.tensor`` is imported only when
        ``t`` is not a plain tensor or parameter.
    """
    if type(t) in PLAIN_TYPES:  # the common case, and the one torch.compile sees
        return False
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensors(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` with each DTensor replaced by its local piece.

    Args:
        tensors (list[Tensor]): plain tensors and DTensors.

    Returns:
        list[Tensor]: the same list when no tensor is a DTensor; otherwise a new list
        in which each DTensor is its ``to_local()``, a view: in-place operations on it
        write through to the DTensor. A rescaling or a zeroing of the pieces is one of
        the whole gradient under every placement, ``Partial`` included.

    .. note::
        No host read, no collective.
    """
    if all(type(t) in PLAIN_TYPES for t in tensors):
        return tensors
    return [t.to_local() if is_dtensor(t) else t for t in tensors]


def refuse_partial(tensors: list[Tensor], caller: str) -> None:
    """Raise ValueError if a DTensor of ``tensors`` has a ``Partial`` placement.

    An elementwise rule (a clamp) applied to each rank's addend of a Partial DTensor is
    not the rule applied to their sum; torch's own ``clip_grad_value_`` raises there too.
    Checked before anything changes.
    """
    for t in tensors:
        if is_dtensor(t) and any(placement.is_partial() for placement in t.placements):
            raise ValueError(
                f"{caller}: a gradient is a DTensor with a Partial placement "
                f"({t.placements}): each rank holds an addend of it, and clamping the "
                "addends is not clamping their sum; redistribute it to Replicate or "
                "Shard first (e.g. t.redistribute(t.device_mesh, [Replicate()]))"
            )


def _without_partial(t: DTensor) -> DTensor:
    """DTensor ``t`` with its ``Partial`` mesh dims all-reduced to ``Replicate``.

    A norm is not linear, so the addends a Partial dim holds must be summed first; this
    is what torch's own DTensor norm does (``common_reduction_strategy`` redistributes a
    Partial input of a non-linear reduction). ``t`` itself is left as it is.
    """
    if not any(placement.is_partial() for placement in t.placements):
        return t
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if pl.is_partial() else pl for pl in t.placements]
    return t.redistribute(t.device_mesh, placements)


def split_dtensors(
    tensors: list[Tensor], process_groups: Sequence[ProcessGroup] = ()
) -> tuple[list[Tensor], list[tuple[list[ProcessGroup], list[Tensor]]]]:
    """Split ``tensors`` into what this rank counts as it is and what it sums over meshes.

    A DTensor is summed over the mesh dims on which it is neither ``Replicate`` nor
    ``Partial`` (``Shard`` and ``_StridedShard``; a Partial dim is all-reduced to a
    copy first), and joins the *domain* of the DTensors on the same mesh with the same
    such dims: one reduction serves them all. A DTensor with no such dim is a copy,
    counted as a plain tensor.

    Args:
        tensors (list[Tensor]): plain tensors and DTensors.
        process_groups (Sequence[ProcessGroup]): the groups the caller reduces over
            afterwards; a domain whose mesh groups share a rank other than this one with
            them is refused, since its entries would be summed twice. Default: ()

    Returns:
        tuple: ``(plain, domains)``: the plain tensors and the local values of the
        replicated DTensors, then one ``(mesh groups, local values)`` pair per domain,
        in the order of first appearance, so that every rank issues the same
        collectives in the same order.

    Raises:
        ValueError: a DTensor's mesh and ``process_groups`` overlap.

    .. note::
        No host read. A DTensor with a ``Partial`` placement costs one all-reduce of its
        own size here (its addends are summed, as torch's DTensor norm sums them); the
        DTensor itself is left as it is.
    """
    _check_meshes(tensors, process_groups, "a DTensor's mesh and process_group")
    plain: list[Tensor] = []
    domains: dict[tuple[object, tuple[int, ...]], tuple[list[ProcessGroup], list[Tensor]]] = {}
    for t in tensors:
        if not is_dtensor(t):
            plain.append(t)
        elif dims := _summed_dims(t):
            key = (t.device_mesh, dims)
            if key not in domains:
                domains[key] = ([t.device_mesh.get_group(d) for d in dims], [])
            domains[key][1].append(_without_partial(t).to_local())
        else:
            plain.append(_without_partial(t).to_local())
    return plain, list(domains.values())


def _summed_dims(t: DTensor) -> tuple[int, ...]:
    """The mesh dims over which DTensor ``t``'s norm is summed.

    Every dim that is neither Replicate (copies) nor Partial (all-reduced to a copy
    first); not ``is_shard()``, which FSDP2 x TP's ``_StridedShard`` fails.
    """
    return tuple(
        d for d, pl in enumerate(t.placements) if not (pl.is_replicate() or pl.is_partial())
    )


def group_beyond_meshes(
    tensors: list[Tensor], process_group: ProcessGroup | None
) -> ProcessGroup | None:
    """What of ``process_group`` the DTensors' own meshes do not already reduce over.

    A DTensor's norm is reduced over the mesh dims it is sharded on. A group that adds
    ranks none of those meshes hold (a pipeline group beside FSDP2 stages) is reduced
    over after them; a group all of whose ranks the meshes already reduce over (the FSDP2
    mesh itself) adds nothing, and reducing over it again would count every shard twice.

    Args:
        tensors (list[Tensor]): DTensors (plain tensors are passed over).
        process_group (ProcessGroup, optional): the group the caller decides over.

    Returns:
        ProcessGroup or None: ``process_group`` where it is disjoint from the meshes
        (sharing this rank only), ``None`` where the meshes cover it.

    Raises:
        ValueError: ``process_group`` overlaps a mesh in part (a world group over FSDP
            and pipeline ranks): which ranks hold other parts cannot be told; pass the
            pipeline group, or the parts themselves (:func:`total_norm`).
    """
    if process_group is None:
        return None
    ranks = _ranks(process_group)
    meshes: set[int] = set()
    for t in tensors:
        if is_dtensor(t):
            for d in _summed_dims(t):
                meshes |= _ranks(t.device_mesh.get_group(d))
    if len(ranks & meshes) <= 1:
        return process_group
    if ranks <= meshes:
        return None
    raise ValueError(
        f"process_group holds the ranks {sorted(ranks)}, of which the DTensors' meshes "
        f"already reduce over {sorted(ranks & meshes)}: a sum over both would count some "
        "shards twice, and the others cannot be told apart. Pass the group the meshes do "
        "not cover (the pipeline group), or the parts with gradlab.distributed.total_norm"
    )


# ---------------------------------------------------------------------------- groups


#: The ranks of each process group seen, by id (the group is kept, so the id stays its).
_RANKS: dict[int, tuple[object, frozenset[int]]] = {}


def _ranks(group: ProcessGroup) -> frozenset[int]:
    entry = _RANKS.get(id(group))
    if entry is None:
        entry = (group, frozenset(torch.distributed.get_process_group_ranks(group)))
        _RANKS[id(group)] = entry
    return entry[1]


def _check_meshes(tensors: list[Tensor], groups: Sequence[ProcessGroup], what: str) -> None:
    """Refuse DTensors whose mesh shares ranks with ``groups`` (see :func:`_check_disjoint`)."""
    if not groups:
        return
    seen = set()
    for t in tensors:
        if is_dtensor(t) and (dims := _summed_dims(t)) and (t.device_mesh, dims) not in seen:
            seen.add((t.device_mesh, dims))
            _check_disjoint([*(t.device_mesh.get_group(d) for d in dims), *groups], what)


def _check_disjoint(groups: Sequence[ProcessGroup], what: str) -> None:
    """Refuse groups that share a rank besides this one: a sum over both double-counts.

    Reducing over groups one after the other sums each piece once only when they are
    the dims of a grid, which meet in this rank alone.
    """
    for i, first in enumerate(groups):
        for second in groups[i + 1 :]:
            shared = _ranks(first) & _ranks(second)
            if len(shared) > 1:
                raise ValueError(
                    f"{what} share the ranks {sorted(shared)}: a tensor summed over both "
                    "would count each piece more than once. A DTensor is reduced over its "
                    "own mesh: pass only the groups it is not sharded over (the pipeline "
                    "group, say), never a group of its mesh"
                )


def _as_groups(groups: ProcessGroups) -> list[ProcessGroup]:
    if groups is None:
        return []
    return list(groups) if isinstance(groups, Sequence) else [groups]


def _group_list(groups: ProcessGroups, name: str) -> list[ProcessGroup]:
    """``groups`` as a list of checked process groups (empty for ``None``)."""
    items = _as_groups(groups)
    for group in items:
        if group is None:
            raise ValueError(f"{name}: a sequence of groups cannot hold None")
        try:
            check_process_group(group)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    _check_disjoint(items, f"the groups of {name}")
    return items


# ------------------------------------------------------------------------ reductions


def _all_reduce(t: Tensor, op: str, groups: Sequence[ProcessGroup]) -> Tensor:
    import torch.distributed as dist

    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    for group in groups:
        dist.all_reduce(t, op=reduce_op, group=group)
    return t


def all_reduce_max(value: Tensor, groups: ProcessGroups) -> Tensor:
    """The maximum of ``value`` over the ranks of ``groups``, NaN wherever any rank's is.

    One all-reduce MAX per group of ``[value, isnan(value)]``, with NaN replaced by
    -inf in the first half: the flag restores a NaN that NCCL's ``fmaxf`` drops from
    every rank, and that gloo drops depending on the rank (see the module notes).

    Args:
        value (Tensor): a floating-point tensor of any shape, reduced entry by entry.
        groups (ProcessGroup or Sequence[ProcessGroup]): the groups to reduce over, one
            after the other; ``None`` or an empty sequence returns ``value`` itself.

    Returns:
        Tensor: a new tensor of ``value``'s shape, dtype and device, the same on every
        rank of the groups. ``value`` is not modified.

    .. note::
        No host read; a collective: call it on every rank of each group, in the same
        order.
    """
    groups = _as_groups(groups)
    if not groups:
        return value
    packed = torch.stack([value, torch.isnan(value).to(value.dtype)])
    packed = torch.where(torch.isnan(packed), torch.full_like(packed, -math.inf), packed)
    _all_reduce(packed, "max", groups)
    return torch.where(packed[1] > 0, torch.full_like(packed[0], math.nan), packed[0])


def all_reduce_norm(
    norm: Tensor, norm_type: float, groups: ProcessGroups, *, scaled: bool
) -> Tensor:
    r"""The p-norm over the ranks of ``groups`` of each rank's norm ``norm``.

    .. math::
        \Bigl(\sum_r n_r^p\Bigr)^{1/p}, \qquad
        M \Bigl(\sum_r (n_r / M)^p\Bigr)^{1/p} \ (\texttt{scaled}), \qquad
        \max_r n_r \ (p = \infty)

    with :math:`M = \max_r n_r` (NaN-safe, :func:`all_reduce_max`). A NaN on any rank
    gives NaN everywhere; an inf (and no NaN) gives inf.

    Args:
        norm (Tensor): this rank's p-norm: 0-dim, or a vector of per-tensor norms
            reduced entry by entry (DTensor's form, as torch reduces them).
        norm_type (float): p, in (0, inf].
        groups (ProcessGroup or Sequence[ProcessGroup]): the groups whose ranks hold
            the other pieces, reduced over one after the other; ``None`` or an empty
            sequence returns ``norm`` itself.
        scaled (bool): use the max-scaled form (an extra MAX), in which
            :math:`n_r^p` can neither overflow nor underflow; :func:`gradlab.get_total_norm`
            uses it for p above 4.

    Returns:
        Tensor: the global norm, of ``norm``'s shape, dtype and device, the same on every
        rank of the groups.

    .. note::
        No host read; one all-reduce per group (two when scaled): call it on every rank
        of each group, in the same order.
    """
    groups = _as_groups(groups)
    if not groups:
        return norm
    if norm_type == math.inf:
        return all_reduce_max(norm, groups)
    if scaled:
        peak = all_reduce_max(norm, groups)
        finite = torch.isfinite(peak)
        scale = torch.where(finite & (peak > 0), peak, torch.ones_like(peak))
        powers = _all_reduce(torch.pow(norm / scale, norm_type), "sum", groups)
        return torch.where(finite, torch.pow(powers, 1.0 / norm_type) * scale, peak)
    # The form of DTensor's _NormPartial, so an FSDP2 norm gets torch's bits.
    powers = _all_reduce(norm**norm_type, "sum", groups)
    return powers ** (1.0 / norm_type)


# ------------------------------------------------------------------------ total norm


def _check_parts(parts: object) -> list[tuple[list[Tensor], list[ProcessGroup]]]:
    if isinstance(parts, Tensor) or not isinstance(parts, Iterable):
        raise ValueError(
            f"parts must be a list of (tensors, groups) pairs, got {type(parts).__name__}"
        )
    checked = []
    for i, part in enumerate(parts):
        if not (isinstance(part, (tuple, list)) and len(part) == 2):
            raise ValueError(
                f"parts[{i}] must be a (tensors, groups) pair, got {type(part).__name__} "
                f"{part!r:.80}"
            )
        tensors = as_tensor_list(part[0], f"parts[{i}][0]")
        groups = _group_list(part[1], f"parts[{i}][1]")
        _check_meshes(tensors, groups, f"a DTensor's mesh and the groups of parts[{i}][1]")
        checked.append((tensors, groups))
    return checked


def total_norm(
    parts: Iterable[tuple[TensorOrTensors, ProcessGroups]],
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    r"""The p-norm of tensors split across ranks over different groups, on every rank.

    .. math::
        \|g\|_p = \Bigl(\sum_k \|g^{(k)}\|_p^p\Bigr)^{1/p}, \qquad
        \|g^{(k)}\|_p = \Bigl(\sum_{r \in G_k} \|g^{(k)}_r\|_p^p\Bigr)^{1/p}

    for parts :math:`k` split over groups :math:`G_k` (the max over parts and ranks for
    the inf-norm). Each part is exactly :func:`gradlab.get_total_norm` with
    ``process_group=`` its groups (the same maths and bits: p up to 4 as torch, larger p
    max-scaled, the inf-norm and every maximum with a NaN flag); the parts' norms, each
    global already, are then combined on this rank. For expert parallelism, whose
    experts are split over the expert-parallel group while the dense parameters are not::

        norm = gradlab.distributed.total_norm(
            [
                (dense_grads, pp_group),             # split over pipeline stages only
                (expert_grads, [ep_group, pp_group]),  # split over experts and stages
            ]
        )
        gradlab.clip_grads_with_norm_(params, max_norm, norm)

    Megatron-style tensor parallelism with plain tensors, where each TP rank holds a
    copy of the LayerNorm weights and biases of row-parallel layers::

        total_norm([(tp_sharded, [tp_group, pp_group]), (tp_replicated, pp_group)])

    **What each rank counts.** Its local value of every tensor of every part, once; a
    DTensor is reduced over its own mesh first, as in :func:`gradlab.get_total_norm`
    (Replicate dims not summed, Partial ones all-reduced). The groups of a part must be
    the ranks holding *different* pieces of it, so that each entry of the model is
    counted on exactly one rank of them: the ranks where the part is a copy (data
    parallel replicas; TP ranks for a replicated tensor; expert-data-parallel ranks for
    an expert) are left out of its groups. Several groups are reduced one after the
    other, as the dims of a grid: two groups of one part, or a group and a DTensor's
    mesh, that share a rank besides this one are refused.

    Args:
        parts (Iterable[tuple]): ``(tensors, groups)`` pairs, the same number of them, in
            the same order, on every rank. ``tensors`` (Tensor or Iterable[Tensor]): the
            gradients of this part on this rank, plain tensors or DTensors; possibly
            none. ``groups`` (ProcessGroup, Sequence[ProcessGroup] or None): the groups
            over which the part is split; ``None``: counted as it is on this rank (the
            same on every rank, or purely local).
        norm_type (float or str): p, a positive number, or ``math.inf`` / ``'inf'``.
            Default: 2.0
        error_if_nonfinite (bool): raise RuntimeError, with torch's message, if the norm
            is NaN or infinite. Default: False
        foreach (bool, optional): see :func:`gradlab.get_total_norm`. Default: None

    Returns:
        Tensor: the total norm, 0-dim, the same bits on every rank when the parts' groups
        are laid out as above; its dtype as :func:`gradlab.get_total_norm` gives (float32
        for 16-bit inputs, float64 if any input is float64). ``tensor(0.)`` for no tensors and no
        groups. A part with no tensors on this rank still takes part in its reductions,
        with a float32 zero: give every rank of a float64 part at least one tensor.

    Raises:
        ValueError: a malformed part, a group that is not a ProcessGroup, that shares
            ranks with another group of its part or with the mesh of one of its
            DTensors, or a bad ``norm_type``; before any collective.
        RuntimeError: torch.distributed is not initialized while a group is given, or
            ``error_if_nonfinite`` is set and the norm is not finite.

    .. note::
        No host read, except ``error_if_nonfinite=True``, which reads the norm.

    .. note::
        Collectives: per part, one or two all-reduces of a few numbers per group and per
        DTensor mesh dim (plus one of the gradient's size for a ``Partial`` DTensor).
        Call it on every rank, with the same parts and dtypes. Parts with the same
        groups are best given as one part: one reduction instead of two.
    """
    from gradlab import clip  # clip imports this module as it loads: no cycle at run time

    p = check_norm_type(norm_type)
    check_flag("error_if_nonfinite", error_if_nonfinite)
    check_foreach(foreach)
    checked = _check_parts(parts)
    norms = [
        clip._global_norm(tensors, p, foreach, groups)[1]
        for tensors, groups in checked
        if tensors or groups  # an empty local part adds nothing and reduces nothing
    ]
    with torch.no_grad():
        total = clip._combine(norms, p) if norms else torch.tensor(0.0)
    if error_if_nonfinite:
        clip._raise_if_nonfinite(total, p, clip._CLIP_ADVICE)
    return total


# ------------------------------------------------------------------------- decisions


def all_reduce_keep(keep: Tensor, process_group: ProcessGroup | None = None) -> Tensor:
    """``keep`` on every rank of ``process_group`` exactly when it is true on all of them.

    Args:
        keep (Tensor): a 0-dim boolean tensor, this rank's decision (true: keep the step).
        process_group (ProcessGroup, optional): the group to agree over; ``None`` is the
            default (world) group. Default: None

    Returns:
        Tensor: a new 0-dim boolean tensor on ``keep``'s device, the same on every rank.

    .. note::
        No host read; one all-reduce (an integer MAX, which has no NaN to lose): call it
        on every rank of the group, on every step.
    """
    import torch.distributed as dist

    rejected = torch.logical_not(keep).to(torch.int32).reshape(1)
    dist.all_reduce(rejected, op=dist.ReduceOp.MAX, group=process_group)
    return rejected[0] == 0


def all_reduce_mean(value: Tensor, process_group: ProcessGroup | None = None) -> Tensor:
    """The mean over the ranks of a 0-dim ``value``, summed in float64, on every rank.

    Used for the loss: the mean of the ranks' losses is the loss of the whole (global)
    batch when the ranks' batches have the same size.

    Args:
        value (Tensor): a 0-dim floating-point tensor, this rank's value.
        process_group (ProcessGroup, optional): the group to average over; ``None`` is
            the default (world) group. Default: None

    Returns:
        Tensor: a new 0-dim tensor of ``value``'s dtype and device, the same on every
        rank. ``value`` is not modified.

    .. note::
        No host read; one all-reduce SUM, which propagates a NaN or inf from any rank
        (a MAX may drop a NaN): call it on every rank of the group.
    """
    import torch.distributed as dist

    total = value.detach().to(torch.float64).reshape(1).clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=process_group)
    return (total[0] / dist.get_world_size(process_group)).to(value.dtype)
