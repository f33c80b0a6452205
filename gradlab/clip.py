r"""Clip or ignore: the gradient-control functions and the total-norm helper.

``clip_grad_norm_``, ``clip_grads_with_norm_`` and ``clip_grad_value_`` reproduce
:mod:`torch.nn.utils`; ``grad_ignore_norm_``, ``grad_ignore_with_norm_`` and
``grad_ignore_value_`` zero the *whole* gradient instead of rescaling it when it is too
large or not finite, so that a bad batch contributes nothing to the update. Zeroing is
not skipping: a zero gradient still moves the parameters through momentum and weight
decay; :class:`gradlab.StepGuard` skips the optimizer step itself.

Every function

* accepts a tensor or any iterable of tensors (a generator such as
  ``model.parameters()`` included) and skips tensors whose ``.grad`` is ``None``;
* groups gradients by device and dtype and uses torch's ``_foreach`` kernels where
  the device supports them;
* never reads a tensor's value on the host (no device-to-host synchronisation),
  except for the check that ``error_if_nonfinite=True`` asks for;
* validates its arguments before touching any gradient;
* compiles with ``torch.compile(fullgraph=True)`` (without ``error_if_nonfinite``).

Where the results are torch's: float32 and float64 gradients give torch's bits, for
``norm_type`` up to 4. float16 and bfloat16 gradients are reduced in float32 (torch
reduces them in their own dtype), so the bits differ, and the result is better:
torch's float16 norm is inf above 65504 and its clipping then zeroes every gradient.

Many processes: ``get_total_norm``, ``clip_grad_norm_``, ``grad_ignore_norm_`` and
``grad_ignore_value_`` reduce DTensor gradients (FSDP2, HSDP, tensor parallelism and
their 2-D meshes) over their own mesh, counting a replicated tensor once, and take
``process_group=`` for pieces held by different ranks of a group (pipeline stages,
tensors sharded by hand): the norm, and so the decision, is then the same on every rank.
:func:`gradlab.distributed.total_norm` adds parts split over different groups (expert
parallelism); :mod:`gradlab.distributed` lists which entries each rank counts. Each
reduction is an all-reduce of one number (or of the per-tensor norms), never a host
read; every maximum travels with a NaN flag, because an all-reduce MAX can drop a NaN.
"""

from __future__ import annotations

import functools
import math
import struct
import types
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from gradlab import distributed
from gradlab._common import (
    EPS,
    PLAIN_TYPES,
    SAME_WIDTH_INT,
    Groups,
    TensorOrTensors,
    Threshold,
    as_tensor_list,
    check_flag,
    check_foreach,
    check_norm_type,
    check_process_group,
    check_real,
    check_threshold_or_tensor,
    constant,
    device_groups,
    use_foreach,
)
from gradlab.flat import FlatGrads, FlatRuns, coalesce

__all__ = [
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "get_total_norm",
    "grad_ignore_norm_",
    "grad_ignore_value_",
    "grad_ignore_with_norm_",
    "keep_by_norm",
    "keep_by_value",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)

#: Above this p, |g|^p leaves the float32 range for gradients of ordinary size
#: (p = 8: every entry below 3e-6 contributes 0), so the norm is taken as
#: m * ||g / m||_p with m = max |g|. Up to it, torch's kernels are used unchanged.
_SCALE_ABOVE_P = 4.0


def _scaled(p: float) -> bool:
    return _SCALE_ABOVE_P < p < math.inf


# --------------------------------------------------------------------------- checks


def _check_total_norm(total_norm: object, name: str = "total_norm") -> Tensor:
    if not (
        isinstance(total_norm, Tensor)
        and total_norm.dim() == 0
        and total_norm.dtype.is_floating_point
    ):
        raise ValueError(
            f"{name} must be a 0-dim floating-point tensor, such as get_total_norm returns, "
            f"got {total_norm!r}"
        )
    if type(total_norm) not in PLAIN_TYPES and distributed.is_dtensor(total_norm):
        # torch.nn.utils.get_total_norm of DTensor gradients: its global value (a
        # collective, which every rank of the mesh makes, as it calls this too).
        return total_norm.full_tensor()
    return total_norm


def _check_eps(eps: object) -> float:
    return EPS if eps is EPS else check_real("eps", eps, 0.0, 1.0)


def _grads_of(parameters: TensorOrTensors | FlatGrads, action: str | None = None) -> list[Tensor]:
    """The gradients of ``parameters`` that exist, in order; a FlatGrads' buffers.

    Views of a common buffer that lie next to each other come back merged into one view
    of their run (:func:`gradlab.flat.coalesce`): the same entries, one kernel per run.
    With ``action``, warn as torch does when ``parameters`` is an empty generator: most
    likely one already consumed, so that the call silently does nothing.
    """
    if isinstance(parameters, FlatGrads):
        return parameters.grads()  # no walk over the parameters
    params = as_tensor_list(parameters, "parameters")
    if action and not params and isinstance(parameters, types.GeneratorType):
        warnings.warn(
            f"`parameters` is an empty generator, no gradient {action} will occur.",
            stacklevel=3,
        )
    # No assignment expression here: dynamo cannot trace one inside a comprehension.
    return coalesce([p.grad for p in params if p.grad is not None])


def _real(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a norm of ``dtype`` entries: complex128 -> float64, as in torch."""
    return dtype.to_real() if dtype.is_complex else dtype


def _accumulation_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """float64 if any input is (complex) float64, else float32: never 16 bits."""
    return torch.float64 if torch.float64 in {_real(d) for d in dtypes} else torch.float32


def _like(threshold: Threshold, ref: Tensor) -> Threshold:
    """A tensor threshold moved to ``ref``'s device and dtype; a float as it is."""
    if isinstance(threshold, Tensor):
        return threshold.to(device=ref.device, dtype=ref.dtype)
    return threshold


def _ratio(max_norm: Threshold, total_norm: Tensor, eps: float = EPS) -> Tensor:
    """``max_norm / (total_norm + eps)``, with the bits torch gets.

    torch computes it as ``float / tensor``, which is ``reciprocal(tensor) * float``,
    after ``float(max_norm)`` (which reads a tensor ``max_norm`` on the host). The same
    two steps, with a tensor rounded to the norm's dtype as that float would be, give
    the same bits without the read.
    """
    if torch.compiler.is_compiling():  # numbers stay numbers, which compile folds
        shifted = total_norm + eps if eps else total_norm
        return torch.reciprocal(shifted) * _like(max_norm, total_norm)
    # Eagerly, cached 0-dim constants: the same bits as the numbers (rounded to the
    # norm's dtype either way), without a wrapped tensor made at every call.
    dtype, device = total_norm.dtype, total_norm.device
    shifted = torch.add(total_norm, constant(eps, dtype, device)) if eps else total_norm
    if isinstance(max_norm, float):
        return torch.reciprocal(shifted) * constant(max_norm, dtype, device)
    return torch.reciprocal(shifted) * _like(max_norm, total_norm)


# ---------------------------------------------------------------------- total norm


#: From this many entries on, a CPU tensor's max |entry| is taken with aminmax.
_AMINMAX_MIN_NUMEL = 1024


def _max_abs_on_cpu(group: list[Tensor], vectorised: bool, dtype: torch.dtype) -> Tensor:
    """max |g| of each (non-empty) CPU tensor of ``group``, as a 1-D tensor of ``dtype``.

    The same numbers as the inf-norm (a max is exact, and NaN propagates through
    both), but faster: torch's CPU inf-norm kernel reads about 8x slower than
    ``aminmax``, and max |g| = max(max g, -min g). A Python call per tensor costs
    more than the kernel for small tensors, so those keep the (foreach) inf-norm.
    The order of the results is not the order of ``group``; a max does not care.
    """
    small = [g for g in group if g.numel() < _AMINMAX_MIN_NUMEL]
    large = [g for g in group if g.numel() >= _AMINMAX_MIN_NUMEL]
    pieces: list[Tensor] = []
    if small:
        norms: list[Tensor] | tuple[Tensor, ...]
        if vectorised:
            norms = torch._foreach_norm(small, math.inf, dtype=dtype)
        else:
            norms = [torch.linalg.vector_norm(g, math.inf, dtype=dtype) for g in small]
        pieces.append(torch.stack(norms))
    if large:
        lows, highs = zip(*(torch.aminmax(g) for g in large), strict=True)
        pieces.append(torch.maximum(torch.stack(highs), torch.stack(lows).neg()).to(dtype))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _scaled_norm(x: Tensor, p: float, dtype: torch.dtype | None = None) -> Tensor:
    r"""``‖x‖_p`` as :math:`m\,\|x/m\|_p` with :math:`m = \max|x|`, on the device.

    Every |x/m| is at most 1, so its p-th power cannot overflow, and the largest is
    1, so the sum cannot underflow to 0. A zero ``m`` divides by 1 instead; an
    infinite or NaN ``m`` is the norm itself (``inf / inf`` would make NaN).
    """
    if dtype is not None:
        x = x.to(dtype)  # a 16-bit x divided in 16 bits would round every x/m
    peak = torch.linalg.vector_norm(x, math.inf)
    finite = torch.isfinite(peak)
    scale = torch.where(finite & (peak > 0), peak, torch.ones_like(peak))
    norm = torch.linalg.vector_norm(x / scale, p) * scale
    return torch.where(finite, norm, peak)


def _group_norms(
    group: list[Tensor], device: torch.device, dtype: torch.dtype, p: float, foreach: bool | None
) -> Tensor:
    """The p-norm of each tensor of one (device, dtype) group, as a 1-D tensor."""
    # float32/float64 keep torch's exact kernel call; 16-bit inputs are reduced in
    # float32, where a norm of a few hundred large entries cannot overflow.
    norm_dtype = torch.float32 if dtype in _LOW_PRECISION else None
    vectorised = use_foreach(group, device, foreach)
    if p == math.inf and device.type == "cpu" and dtype.is_floating_point:
        return _max_abs_on_cpu(group, vectorised, norm_dtype or dtype)
    if _scaled(p):
        return torch.stack([_scaled_norm(g, p, norm_dtype) for g in group])
    if vectorised:
        return torch.stack(torch._foreach_norm(group, p, dtype=norm_dtype))
    return torch.stack([torch.linalg.vector_norm(g, p, dtype=norm_dtype) for g in group])


def _buffer_norm(buffer: Tensor, p: float) -> Tensor:
    """The p-norm of one non-empty tensor, 0-dim, as ``_group_norms`` takes each: a
    float32 reduction of 16-bit entries, max |g| by ``aminmax`` on a CPU, scaled above
    p = 4."""
    norm_dtype = torch.float32 if buffer.dtype in _LOW_PRECISION else None
    if p == math.inf and buffer.device.type == "cpu" and buffer.dtype.is_floating_point:
        low, high = torch.aminmax(buffer)  # see _max_abs_on_cpu
        largest = torch.maximum(high, low.neg())
        return largest if norm_dtype is None else largest.to(norm_dtype)
    if _scaled(p):
        return _scaled_norm(buffer, p, norm_dtype)
    return torch.linalg.vector_norm(buffer, p, dtype=norm_dtype)


def _total_norm(
    tensors: list[Tensor],
    p: float,
    foreach: bool | None,
    groups: Groups,
    per_tensor_hook: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    r"""The p-norm of ``tensors`` viewed as one vector (no argument checks).

    Uses :math:`\|g\|_p = \bigl\|(\|g_1\|_p, \dots, \|g_k\|_p)\bigr\|_p`: the norm of
    the per-tensor norms, so no concatenated copy is ever made. ``groups`` is
    ``device_groups(tensors)``. Up to p = 4 the vector of per-tensor norms is the one torch
    builds (same values; the same order, or any order for a max), so the result is
    bit-for-bit torch's wherever torch computes the same per-tensor norms.
    ``per_tensor_hook``, if given, maps the vector of per-tensor norms before the final
    norm (the DTensor path reduces it across ranks there, as DTensor does).
    """
    if not tensors:
        return torch.tensor(0.0)
    first_device = tensors[0].device
    acc_dtype = _accumulation_dtype(dtype for _, dtype, _ in groups)
    pieces: list[Tensor] = []  # one 1-D tensor of per-tensor norms per group
    for device, dtype, group in groups:
        if p == math.inf or _scaled(p):
            # Both take a max, which torch's kernels refuse over an empty tensor. Its
            # norm is 0 and changes no total (every norm is >= 0): leave it out.
            group = [g for g in group if g.numel() > 0]
            if not group:
                continue
        piece = _group_norms(group, device, dtype, p, foreach)
        # One .to() per group, not one per tensor, and none when nothing changes (the
        # call alone costs microseconds: as much as the norm of a flat buffer's tail).
        if piece.dtype != acc_dtype or piece.device != first_device:
            piece = piece.to(device=first_device, dtype=acc_dtype)
        pieces.append(piece)
    if not pieces:  # only empty tensors, and the inf-norm or a large p
        return torch.zeros((), dtype=acc_dtype, device=first_device)
    per_tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if per_tensor_hook is not None:
        per_tensor = per_tensor_hook(per_tensor)
    if _scaled(p):
        return _scaled_norm(per_tensor, p)
    return torch.linalg.vector_norm(per_tensor, p)


def _raise_if_nonfinite(total_norm: Tensor, p: float, advice: str) -> None:
    value = total_norm.item()  # the one host read the caller asked for
    if not math.isfinite(value):
        # torch's wording, so that code matching torch's message keeps working.
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, {advice}"
        )


_CLIP_ADVICE = (
    "so it cannot be clipped. To disable this error and scale the gradients by the "
    "non-finite norm anyway, set `error_if_nonfinite=False`"
)
_IGNORE_ADVICE = (
    "so the gradients would be zeroed. To disable this error and zero them, "
    "set `error_if_nonfinite=False`"
)


def _combine(norms: list[Tensor], p: float) -> Tensor:
    """The p-norm of a few 0-dim norms (each already global): the norm of their vector."""
    if len(norms) == 1:
        return norms[0]
    dtype = _accumulation_dtype(n.dtype for n in norms)
    vector = torch.stack([n.to(device=norms[0].device, dtype=dtype) for n in norms])
    return _scaled_norm(vector, p) if _scaled(p) else torch.linalg.vector_norm(vector, p)


def _empty_norm(groups: list) -> Tensor:
    """The norm of no tensors, on a device the groups' backend can reduce."""
    if groups and torch.distributed.get_backend(groups[0]) == "nccl":
        return torch.zeros((), device=torch.device("cuda", torch.cuda.current_device()))
    return torch.tensor(0.0)


def _global_norm(
    tensors: list[Tensor], p: float, foreach: bool | None, process_group: object
) -> tuple[Groups, Tensor]:
    """(groups of the local tensors, the global norm): DTensors and/or process groups.

    Each DTensor domain's norm is reduced over its mesh; plain tensors count as they
    are on this rank. The norm of all of it is then reduced over ``process_group`` (a
    group, or a list of groups one after the other), as the norm of tensors split
    across its ranks. :func:`gradlab.distributed.total_norm` calls this once per part.
    """
    if process_group is None:
        groups = []
    elif isinstance(process_group, list):
        groups = process_group
    else:
        groups = [process_group]
    local = distributed.local_tensors(tensors)
    with torch.no_grad():
        plain, domains = distributed.split_dtensors(tensors, groups)
        pieces = []
        if plain:
            pieces.append(_total_norm(plain, p, foreach, device_groups(plain)))
        for mesh_groups, shards in domains:
            if p == math.inf or _scaled(p):
                norm = _total_norm(shards, p, foreach, device_groups(shards))
                pieces.append(distributed.all_reduce_norm(norm, p, mesh_groups, scaled=_scaled(p)))
            else:
                # Up to p = 4, as torch's DTensor norm: each tensor's norm made global
                # (one all-reduce of their p-th powers), then the norm of those norms.
                def hook(norms: Tensor, mesh_groups: list = mesh_groups) -> Tensor:
                    return distributed.all_reduce_norm(norms, p, mesh_groups, scaled=False)

                pieces.append(_total_norm(shards, p, foreach, device_groups(shards), hook))
        total = _combine(pieces, p) if pieces else _empty_norm(groups)
        if groups:
            total = distributed.all_reduce_norm(total, p, groups, scaled=_scaled(p))
    return device_groups(local), total


def _norm_of_grads(
    tensors: list[Tensor],
    norm_type: object,
    error_if_nonfinite: object,
    foreach: object,
    advice: str,
    process_group: object = None,
) -> tuple[Groups, Tensor]:
    """Check the arguments, then (groups of ``tensors``' local values, their total norm).

    The groups hold each DTensor's local shard, so that in-place updates reach it.
    """
    p = check_norm_type(norm_type)
    check_flag("error_if_nonfinite", error_if_nonfinite)
    foreach = check_foreach(foreach)
    check_process_group(process_group)
    one = len(tensors) == 1
    if process_group is None and one and isinstance(tensors, FlatRuns) and tensors[0].numel():
        # One flat buffer: its own group, and its norm is the total, one kernel (a norm of
        # one number would only round it again). A buffer needs no no_grad (no autograd).
        buffer = tensors[0]
        groups: Groups = [(buffer.device, buffer.dtype, tensors)]
        if buffer.requires_grad:
            with torch.no_grad():
                total = _buffer_norm(buffer, p)
        else:
            total = _buffer_norm(buffer, p)
    elif process_group is None and all(type(t) in PLAIN_TYPES for t in tensors):
        # One tensor is its own group, without torch's grouping call.
        groups = [(tensors[0].device, tensors[0].dtype, tensors)] if one else device_groups(tensors)
        with torch.no_grad():
            total = _total_norm(tensors, p, foreach, groups)
    else:
        groups, total = _global_norm(tensors, p, foreach, process_group)
    if error_if_nonfinite:
        _raise_if_nonfinite(total, p, advice)
    return groups, total


def get_total_norm(
    tensors: TensorOrTensors | FlatGrads,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: torch.distributed.ProcessGroup | None = None,
) -> Tensor:
    r"""Compute the p-norm of a collection of tensors viewed as one concatenated vector.

    .. math::
        \|g\|_p = \Bigl(\sum_i \sum_j |g_{ij}|^p\Bigr)^{1/p}
               = \bigl\|(\|g_1\|_p, \ldots, \|g_k\|_p)\bigr\|_p,
        \qquad \|g\|_\infty = \max_{i,j} |g_{ij}|.

    For ``norm_type`` above 4 each norm is taken as :math:`m\,\|g/m\|_p` with
    :math:`m = \max|g|`, so that :math:`|g|^p` neither underflows to 0 nor overflows
    (an extra pass and a temporary copy per tensor); up to 4 the result is torch's.

    Across ranks (``process_group``, or DTensor gradients), with :math:`n_r` the norm
    on rank r: :math:`(\sum_r n_r^p)^{1/p}` by an all-reduce SUM for p up to 4 (for
    DTensors, what ``torch.nn.utils.get_total_norm(...).full_tensor()`` computes);
    :math:`M\,(\sum_r (n_r/M)^p)^{1/p}` with :math:`M = \max_r n_r` for larger p, so
    that nothing overflows or underflows; :math:`\max_r n_r` for the inf-norm. Every
    maximum is reduced with a separate NaN flag, because an all-reduce MAX can drop a
    NaN (NCCL's ``fmaxf`` drops it from any rank, gloo depending on the rank); a NaN or
    inf on one rank makes the norm NaN or inf on every rank.

    Which entries each rank counts: a DTensor is summed over the mesh dims on which it
    is sharded (``Shard``, ``_StridedShard``) and not over its ``Replicate`` dims, whose
    copies count once (tensor-parallel LayerNorm weights; ``(Shard(0), Replicate())``
    under FSDP x TP); a ``Partial`` gradient (``SequenceParallel``) is all-reduced first,
    as torch's DTensor norm does; a plain tensor counts as it is on this rank. All of it
    is then summed over ``process_group``. See :mod:`gradlab.distributed` for the
    recipes (DDP, FSDP2, TP, pipeline stages, experts) and
    :func:`gradlab.distributed.total_norm` for parts split over different groups.

    Args:
        tensors (Tensor or Iterable[Tensor]): the values whose norm is taken (typically
            gradients, not parameters).
        norm_type (float or str): p, a positive number, or ``math.inf`` / ``'inf'``.
            Default: 2.0
        error_if_nonfinite (bool): raise RuntimeError, with torch's message, if the norm
            is NaN or infinite. Default: False
        foreach (bool, optional): ``None`` picks the foreach kernels where the device
            supports them; ``True`` demands them (RuntimeError where unsupported);
            ``False`` loops. Default: None
        process_group (ProcessGroup, optional): the group whose ranks hold different
            pieces of the tensors: pipeline stages (torchtitan's ``pp_mesh.get_group()``),
            or tensors sharded by hand; the norm is then the norm of all the pieces,
            the same bits on every rank. DTensors are reduced over their own mesh first: a
            group sharing ranks with their mesh is refused (ValueError). ``None``: this
            rank's plain tensors as they are. Default: None

    Returns:
        Tensor: the total norm, 0-dim, on the first tensor's device. Its dtype is the
        real dtype of the inputs (complex128 gives float64), float32 for float16 and
        bfloat16 inputs, float64 if any input is float64. ``tensor(0.)`` for no tensors.
        For DTensors, a plain tensor holding the global norm (torch returns a DTensor
        whose ``full_tensor()`` is that norm).

    Raises:
        ValueError: ``norm_type`` is not a positive number or inf.
        RuntimeError: ``error_if_nonfinite`` is set and the norm is not finite.

    .. note::
        No host read, except ``error_if_nonfinite=True``, which reads the norm.

    .. note::
        With ``process_group``, or DTensor gradients, the call issues collectives
        (one or two all-reduces of a few numbers, no host read): call it on every
        rank of the group, with gradients of the same dtypes.
    """
    tensors = (
        tensors.grads()
        if isinstance(tensors, FlatGrads)
        else coalesce(as_tensor_list(tensors, "tensors"))
    )
    _, total = _norm_of_grads(
        tensors, norm_type, error_if_nonfinite, foreach, _CLIP_ADVICE, process_group
    )
    return total


# ------------------------------------------------------------------------ clipping


def _clip_(
    groups: Groups, max_norm: Threshold, total_norm: Tensor, foreach: bool | None, eps: float = EPS
) -> None:
    # The clamped coefficient is always multiplied, never branched on: an `if coef < 1`
    # would read it on the host.
    coef = torch.clamp(_ratio(max_norm, total_norm, eps), max=1.0)
    for device, _, group in groups:
        coef_here = coef if coef.device == device else coef.to(device)
        if use_foreach(group, device, foreach) and len(group) > 1:
            torch._foreach_mul_(group, coef_here)
        else:
            for g in group:
                g.mul_(coef_here)


def clip_grads_with_norm_(
    parameters: TensorOrTensors | FlatGrads,
    max_norm: float | Tensor,
    total_norm: Tensor,
    foreach: bool | None = None,
    *,
    eps: float = EPS,
) -> None:
    r"""Rescale all gradients, given their total norm, so that it is at most ``max_norm``.

    .. math::
        g \leftarrow g \cdot \min\Bigl(1, \frac{\text{max\_norm}}{s + \epsilon}\Bigr),
        \qquad s = \text{total\_norm}, \quad \epsilon = 10^{-6}

    The second phase of :func:`clip_grad_norm_`, as in
    :func:`torch.nn.utils.clip_grads_with_norm_`: pass a norm computed elsewhere, for
    example a :func:`get_total_norm` all-reduced across the ranks of sharded training.
    To zero the gradients instead, see :func:`grad_ignore_with_norm_`.

    There is no ``process_group`` argument: a norm from :func:`get_total_norm` with one
    is already the same on every rank, and so is the coefficient. A DTensor
    ``total_norm`` (``torch.nn.utils.get_total_norm`` of FSDP2 gradients) is replaced
    by its ``full_tensor()``, a collective; DTensor gradients are rescaled shard by shard.

    Args:
        parameters (Tensor or Iterable[Tensor]): tensors whose ``.grad`` is rescaled in
            place; tensors without a gradient are skipped.
        max_norm (float or Tensor): the largest total norm allowed, a non-negative
            number, or a 0-dim tensor, used on the device as it is (unchecked).
        total_norm (Tensor): the 0-dim total norm of the gradients.
        foreach (bool, optional): see :func:`get_total_norm`. Default: None
        eps (float): :math:`\epsilon`, torch's 1e-6 (which keeps ``max_norm / 0`` finite).
            0 rescales to exactly ``max_norm`` (a zero norm gives a coefficient of 1), for
            thresholds that may be far below 1e-6. Default: 1e-6

    Returns:
        None

    .. note::
        No host read.
    """
    max_norm = check_threshold_or_tensor("max_norm", max_norm)
    total_norm = _check_total_norm(total_norm)
    check_foreach(foreach)
    eps = _check_eps(eps)
    grads = distributed.local_tensors(_grads_of(parameters))
    with torch.no_grad():
        _clip_(device_groups(grads), max_norm, total_norm, foreach, eps)


def clip_grad_norm_(
    parameters: TensorOrTensors | FlatGrads,
    max_norm: float | Tensor,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: torch.distributed.ProcessGroup | None = None,
) -> Tensor:
    r"""Rescale all gradients together so that their total norm is at most ``max_norm``.

    .. math::
        c = \min\Bigl(1, \frac{\text{max\_norm}}{\|g\|_p + 10^{-6}}\Bigr),
        \qquad g \leftarrow c\, g .

    The direction of the whole gradient is kept. Equivalent to :func:`get_total_norm`
    followed by :func:`clip_grads_with_norm_`, like
    :func:`torch.nn.utils.clip_grad_norm_`, with torch's bits for float32 and float64
    gradients (``norm_type`` up to 4). float16 and bfloat16 gradients get a float32
    norm: where torch's float16 norm overflows to inf (above 65504) and torch zeroes
    every gradient, this clips to the true norm.

    A non-finite norm wrecks the gradient, as in torch: a NaN norm makes every entry
    NaN, and an infinite one gives ``max_norm / inf = 0``, which zeroes the finite
    entries and turns the infinite ones into NaN (``inf * 0``). Use
    :func:`grad_ignore_norm_` (zero the gradients) or :class:`gradlab.StepGuard`
    (skip the step), or ``error_if_nonfinite=True``, to guard against that.

    Args:
        parameters (Tensor or Iterable[Tensor]): tensors whose ``.grad`` is rescaled in
            place; tensors without a gradient are skipped. An empty generator warns.
        max_norm (float or Tensor): the largest total norm allowed, a non-negative
            number, or a 0-dim tensor, used on the device as it is (unchecked).
        norm_type (float or str): p, a positive number, or ``math.inf`` / ``'inf'``.
            Default: 2.0
        error_if_nonfinite (bool): raise RuntimeError, before any gradient changes, if
            the total norm is NaN or infinite. Default: False
        foreach (bool, optional): see :func:`get_total_norm`. Default: None
        process_group (ProcessGroup, optional): the group whose ranks hold different
            pieces of the gradients: pipeline stages (torchtitan's ``pp_mesh.get_group()``),
            or tensors sharded by hand; the norm is then the norm of all the pieces,
            the same bits on every rank. DTensors are reduced over their own mesh first: a
            group sharing ranks with their mesh is refused (ValueError). ``None``: this
            rank's plain tensors as they are. Default: None

    Returns:
        Tensor: the total norm of the gradients *before* clipping, 0-dim (the global
        norm, the same on every rank, with ``process_group`` or DTensor gradients).

    .. note::
        No host read, except ``error_if_nonfinite=True``, which reads the norm.

    .. note::
        With ``process_group``, or DTensor gradients, the call issues collectives
        (one or two all-reduces of a few numbers, no host read): call it on every
        rank of the group, with gradients of the same dtypes. Every rank then scales by the same
        coefficient.
    """
    max_norm = check_threshold_or_tensor("max_norm", max_norm)
    grads = _grads_of(parameters, "clipping")
    groups, total = _norm_of_grads(
        grads, norm_type, error_if_nonfinite, foreach, _CLIP_ADVICE, process_group
    )
    with torch.no_grad():
        _clip_(groups, max_norm, total, foreach)
    return total


def _clamp_bound(clip_value: Threshold, device: torch.device, dtype: torch.dtype) -> Threshold:
    """``clip_value`` as the clamps of one group take it: a number, or a 0-dim tensor.

    torch's clamps refuse a number outside the range of the gradients' dtype (65504 for
    float16); a float64 tensor is rounded to that dtype instead, which gives the same
    result as clamping exactly and rounding afterwards.
    """
    if isinstance(clip_value, Tensor):
        return clip_value.to(device)
    if dtype.is_floating_point and clip_value > torch.finfo(dtype).max:
        return torch.tensor(clip_value, dtype=torch.float64, device=device)
    return clip_value


def clip_grad_value_(
    parameters: TensorOrTensors | FlatGrads,
    clip_value: float | Tensor,
    foreach: bool | None = None,
) -> None:
    r"""Clamp every gradient entry into ``[-clip_value, clip_value]``.

    .. math::
        g_{ij} \leftarrow \min\bigl(\max(g_{ij}, -\text{clip\_value}), \text{clip\_value}\bigr)

    Each entry is clamped on its own, so the direction of the gradient generally
    changes. Same gradients as :func:`torch.nn.utils.clip_grad_value_`, in every dtype
    (a NaN entry stays NaN); a ``clip_value`` beyond the range of the gradients' dtype
    (above 65504 for float16), which torch refuses, clamps as if exactly and rounds.
    To zero the gradients instead, see :func:`grad_ignore_value_`.

    Args:
        parameters (Tensor or Iterable[Tensor]): tensors whose ``.grad`` is clamped in
            place; tensors without a gradient are skipped.
        clip_value (float or Tensor): the largest absolute value allowed, a non-negative
            number, or a 0-dim tensor, used on the device as it is (unchecked).
        foreach (bool, optional): see :func:`get_total_norm`. Default: None

    Returns:
        None. (It does not return a norm, whatever some tutorials say.)

    .. note::
        No host read.
    """
    clip_value = check_threshold_or_tensor("clip_value", clip_value)
    check_foreach(foreach)
    grads = _grads_of(parameters)
    distributed.refuse_partial(grads, "clip_grad_value_")
    with torch.no_grad():
        _clamp_(device_groups(distributed.local_tensors(grads)), clip_value, foreach)


def _clamp_(groups: Groups, clip_value: Threshold, foreach: bool | None) -> None:
    for device, dtype, group in groups:
        bound = _clamp_bound(clip_value, device, dtype)
        # One tensor (a flat buffer): one pass clamping both sides, the same values.
        if use_foreach(group, device, foreach) and len(group) > 1:
            # The foreach clamps take a number, or one tensor per gradient.
            if isinstance(bound, Tensor):
                torch._foreach_clamp_min_(group, [-bound] * len(group))
                torch._foreach_clamp_max_(group, [bound] * len(group))
            else:
                torch._foreach_clamp_min_(group, -bound)
                torch._foreach_clamp_max_(group, bound)
        else:
            for g in group:
                g.clamp_(min=-bound, max=bound)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ ignoring


def _zero_unless(groups: Groups, keep: Tensor, foreach: bool | None) -> None:
    """Zero every gradient unless the 0-dim boolean ``keep`` is true, on the device.

    This must be a select, not a float multiplication: ``NaN * 0`` is NaN, so
    multiplying by a 0/1 mask would leave NaN behind in exactly the case an ignore
    exists for. torch has no foreach select, so the select is done on the bits: each
    gradient is viewed (no copy) as integers of the same width and multiplied by the
    integer 0 or 1. Times 1 keeps every bit, NaN payloads and -0.0 included; times 0
    gives all-zero bits, which is +0.0 in every IEEE format. An integer product
    never looks at what the bits mean, so NaN and inf become 0 like anything else,
    and it is one foreach kernel per group instead of one kernel per tensor.
    """
    for device, dtype, group in groups:
        int_dtype = SAME_WIDTH_INT.get(dtype.itemsize) if dtype.is_floating_point else None
        if int_dtype is None:  # complex gradients, say: select tensor by tensor
            keep_here = keep.to(device)
            zero = torch.zeros((), dtype=dtype, device=device)
            for g in group:
                torch.where(keep_here, g, zero, out=g)
            continue
        factor = keep.to(device=device, dtype=int_dtype)
        bits = [g.view(int_dtype) for g in group]
        if use_foreach(group, device, foreach) and len(group) > 1:
            torch._foreach_mul_(bits, factor)
        else:
            for b in bits:
                b.mul_(factor)


def keep_by_norm(total_norm: Tensor, max_norm: float | Tensor, *, eps: float = EPS) -> Tensor:
    r"""Whether gradients of total norm ``total_norm`` are within ``max_norm``, on the device.

    .. math::
        \text{keep} \iff \frac{\text{max\_norm}}{\text{total\_norm} + \epsilon} \ge 1,
        \qquad \epsilon = 10^{-6}

    The rule of :func:`grad_ignore_norm_` and of :class:`gradlab.StepGuard`: kept
    exactly when :func:`clip_grad_norm_` would not rescale, with torch's rounding of
    the clip coefficient (``reciprocal(total_norm + 1e-6) * max_norm``). A NaN norm
    fails the ``>=`` and an infinite one gives ``0 >= 1``: neither is kept. The +1e-6
    makes every norm above ``max_norm - 1e-6`` fail, so a threshold below about 1e-5
    is mostly that epsilon: pass ``eps=0`` for such scales (what
    :class:`gradlab.StepGuard` does with a threshold policy).

    Args:
        total_norm (Tensor): a 0-dim floating-point norm (>= 0, or NaN or inf), such as
            :func:`get_total_norm` returns.
        max_norm (float or Tensor): the largest norm kept, a non-negative number, or a
            0-dim tensor, used on the device as it is.
        eps (float): :math:`\epsilon`, as in :func:`clip_grads_with_norm_`, whose
            rescaling this decision matches. Default: 1e-6

    Returns:
        Tensor: 0-dim ``torch.bool`` on ``total_norm``'s device.

    With a number ``max_norm`` and a float32 or float64 norm, the rule is evaluated as
    one comparison, ``total_norm <= b``, with the same result: ``b`` is the largest
    number of the norm's dtype that the rule keeps, found once per threshold on the
    host by bisection over the dtype's bit patterns, evaluating the rule in that
    dtype's IEEE arithmetic (the rule is monotone for norms >= 0, since no rounding
    reverses an order). Why: after an optimizer step every small kernel costs a few
    microseconds on a CPU, and the rule is four of them. A tensor ``max_norm``, other
    dtypes and :func:`torch.compile` take the rule as written.

    .. note::
        No host read (the bisection is Python arithmetic, no tensor). Compose it with any
        other condition on the device (``keep_by_norm(n, 1.0) & (loss < 10)``) and pass
        it to :func:`gradlab.step_if_`.
    """
    max_norm = check_threshold_or_tensor("max_norm", max_norm)
    total_norm, eps = _check_total_norm(total_norm), _check_eps(eps)
    if isinstance(max_norm, float) and _fast_path(total_norm):
        bound = _largest_kept_norm(max_norm, eps, total_norm.dtype)
        return torch.le(total_norm, constant(bound, total_norm.dtype, total_norm.device))
    return _ratio(max_norm, total_norm, eps) >= 1.0


def keep_by_value(largest: Tensor, clip_value: float | Tensor) -> Tensor:
    r"""Whether a largest absolute gradient entry ``largest`` is below ``clip_value``.

    .. math::
        \text{keep} \iff \text{largest} < \text{clip\_value}

    The rule of :func:`grad_ignore_value_`, compared in float64 so that the threshold
    is not rounded to the gradients' precision first; a NaN or infinite ``largest``
    is not kept. ``largest`` is the inf-norm, ``get_total_norm(grads, math.inf)``.

    Args:
        largest (Tensor): a 0-dim floating-point maximum of absolute values.
        clip_value (float or Tensor): the smallest absolute entry that is not kept, a
            non-negative number, or a 0-dim tensor, used on the device as it is.

    Returns:
        Tensor: 0-dim ``torch.bool`` on ``largest``'s device.

    .. note::
        No host read.
    """
    clip_value = check_threshold_or_tensor("clip_value", clip_value)
    largest = _check_total_norm(largest, "largest")
    if isinstance(clip_value, float) and _fast_path(largest):
        bound = _largest_below(clip_value, largest.dtype)
        return torch.le(largest, constant(bound, largest.dtype, largest.device))
    wide = largest.to(torch.float64)
    return wide < _like(clip_value, wide)


# ------------------------------------------------------------- one-comparison rules


def _fast_path(stat: Tensor) -> bool:
    return stat.dtype in _HOST_FORMATS and not torch.compiler.is_compiling()


#: The dtypes whose arithmetic the host reproduces exactly: float64 is Python's float,
#: float32 is a float rounded with struct (double rounding is harmless for +, *, / of
#: float32 operands: a double holds more than 2 * 24 + 2 bits, Figueroa 1995).
_HOST_FORMATS = {torch.float32: "<f", torch.float64: "<d"}
_BITS = {torch.float32: "<I", torch.float64: "<Q"}
#: float32 numbers at or above this round to inf (the midpoint of FLT_MAX and 2**128).
_F32_TO_INF = 2.0**128 - 2.0**103


def _rounded(x: float, dtype: torch.dtype) -> float:
    """``x`` rounded to the nearest ``dtype`` number, ties to even, overflow to inf."""
    if dtype == torch.float64 or math.isnan(x) or math.isinf(x):
        return x
    if abs(x) >= _F32_TO_INF:
        return math.copysign(math.inf, x)
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _from_bits(pattern: int, dtype: torch.dtype) -> float:
    return struct.unpack(_HOST_FORMATS[dtype], struct.pack(_BITS[dtype], pattern))[0]


def _to_bits(x: float, dtype: torch.dtype) -> int:
    return struct.unpack(_BITS[dtype], struct.pack(_HOST_FORMATS[dtype], x))[0]


def _norm_rule_on_host(norm: float, max_norm: float, eps: float, dtype: torch.dtype) -> bool:
    """``reciprocal(norm + eps) * max_norm >= 1`` in ``dtype`` arithmetic, as torch rounds
    it: the Python numbers are rounded to ``dtype`` first, each result after each op."""
    shifted = _rounded(norm + _rounded(eps, dtype), dtype) if eps else norm
    inverse = math.inf if shifted == 0 else _rounded(1.0 / shifted, dtype)
    return _rounded(inverse * _rounded(max_norm, dtype), dtype) >= 1.0


@functools.lru_cache(maxsize=1024)
def _largest_kept_norm(max_norm: float, eps: float, dtype: torch.dtype) -> float:
    """The largest ``dtype`` number >= 0 that keep_by_norm's rule keeps (-inf if none).

    The rule is false at inf (``1/inf * max_norm`` is 0 or NaN) and monotone in the norm,
    so bisecting the bit patterns of [0, inf], which are ordered as the numbers, finds
    the boundary in at most 64 evaluations.
    """
    if not _norm_rule_on_host(0.0, max_norm, eps, dtype):
        return -math.inf
    kept, over = 0, _to_bits(math.inf, dtype)
    while over - kept > 1:
        middle = (kept + over) // 2
        if _norm_rule_on_host(_from_bits(middle, dtype), max_norm, eps, dtype):
            kept = middle
        else:
            over = middle
    return _from_bits(kept, dtype)


@functools.lru_cache(maxsize=1024)
def _largest_below(clip_value: float, dtype: torch.dtype) -> float:
    """The largest ``dtype`` number below ``clip_value`` (keep_by_value's boundary)."""
    nearest = _rounded(clip_value, dtype)
    if nearest < clip_value:
        return nearest
    if nearest == 0:  # the largest number below +0 is the smallest negative one
        return -_from_bits(1, dtype)
    return _from_bits(_to_bits(nearest, dtype) - 1, dtype)  # nearest > 0 here


def grad_ignore_with_norm_(
    parameters: TensorOrTensors | FlatGrads,
    max_norm: float | Tensor,
    total_norm: Tensor,
    foreach: bool | None = None,
) -> None:
    r"""Zero *every* gradient, given their total norm, when it is too large or not finite.

    .. math::
        \text{keep} \iff \frac{\text{max\_norm}}{\text{total\_norm} + 10^{-6}} \ge 1,
        \qquad g \leftarrow \begin{cases} g & \text{keep} \\ 0 & \text{otherwise.} \end{cases}

    The second phase of :func:`grad_ignore_norm_`, the counterpart of
    :func:`clip_grads_with_norm_`: pass a norm computed elsewhere, for example a
    :func:`get_total_norm` all-reduced across the ranks of sharded training, so that
    every rank makes the same decision. Zeroing is not skipping: to leave the
    parameters and the optimizer state untouched, use
    :class:`gradlab.StepGuard` with ``mode="skip"``.

    As in :func:`clip_grads_with_norm_`, there is no ``process_group`` argument (a
    reduced norm already decides alike everywhere), and a DTensor ``total_norm`` is
    replaced by its ``full_tensor()``.

    Args:
        parameters (Tensor or Iterable[Tensor]): tensors whose ``.grad`` may be zeroed in
            place; tensors without a gradient are skipped.
        max_norm (float or Tensor): the largest total norm kept, a non-negative number,
            or a 0-dim tensor, used on the device as it is (unchecked).
        total_norm (Tensor): the 0-dim total norm of the gradients.
        foreach (bool, optional): see :func:`get_total_norm`. Default: None

    Returns:
        None

    .. note::
        No host read.
    """
    max_norm = check_threshold_or_tensor("max_norm", max_norm)
    total_norm = _check_total_norm(total_norm)
    check_foreach(foreach)
    grads = distributed.local_tensors(_grads_of(parameters))
    with torch.no_grad():
        _zero_unless(device_groups(grads), keep_by_norm(total_norm, max_norm), foreach)


def grad_ignore_norm_(
    parameters: TensorOrTensors | FlatGrads,
    max_norm: float | Tensor,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: torch.distributed.ProcessGroup | None = None,
) -> Tensor:
    r"""Zero *every* gradient when their total norm is too large or not finite.

    .. math::
        \text{keep} \iff \frac{\text{max\_norm}}{\|g\|_p + 10^{-6}} \ge 1,
        \qquad g \leftarrow \begin{cases} g & \text{keep} \\ 0 & \text{otherwise.} \end{cases}

    Equivalent to :func:`get_total_norm` followed by :func:`grad_ignore_with_norm_`.
    A NaN norm fails the comparison (every comparison with NaN is false), and an
    infinite norm gives ``max_norm / inf = 0 < 1``: both are ignored and leave zeros,
    never NaN. Kept gradients are untouched bit for bit. The test matches
    :func:`clip_grad_norm_`: a gradient is ignored exactly when clipping would have
    rescaled it. Zeroing is not skipping: a zero gradient still moves the parameters
    through momentum and weight decay; :class:`gradlab.StepGuard` with
    ``mode="skip"`` skips the step instead.

    Args:
        parameters (Tensor or Iterable[Tensor]): tensors whose ``.grad`` may be zeroed in
            place; tensors without a gradient are skipped. An empty generator warns.
        max_norm (float or Tensor): the largest total norm kept, a non-negative number,
            or a 0-dim tensor, used on the device as it is (unchecked).
        norm_type (float or str): p, a positive number, or ``math.inf`` / ``'inf'``.
            Default: 2.0
        error_if_nonfinite (bool): raise RuntimeError, before any gradient changes, if
            the total norm is NaN or infinite. Default: False
        foreach (bool, optional): see :func:`get_total_norm` (used for the norm and the
            zeroing). Default: None
        process_group (ProcessGroup, optional): the group whose ranks hold different
            pieces of the gradients: pipeline stages (torchtitan's ``pp_mesh.get_group()``),
            or tensors sharded by hand; the norm is then the norm of all the pieces,
            the same bits on every rank. DTensors are reduced over their own mesh first: a
            group sharing ranks with their mesh is refused (ValueError). ``None``: this
            rank's plain tensors as they are. Default: None

    Returns:
        Tensor: the total norm of the gradients before the decision, 0-dim (the global
        norm, the same on every rank, with ``process_group`` or DTensor gradients).

    .. note::
        No host read, except ``error_if_nonfinite=True``, which reads the norm.

    .. note::
        With ``process_group``, or DTensor gradients, the call issues collectives
        (one or two all-reduces of a few numbers, no host read): call it on every
        rank of the group, with gradients of the same dtypes. Every rank then keeps, or zeroes,
        alike: a NaN on one rank zeroes all.
    """
    max_norm = check_threshold_or_tensor("max_norm", max_norm)
    grads = _grads_of(parameters, "ignoring")
    groups, total = _norm_of_grads(
        grads, norm_type, error_if_nonfinite, foreach, _IGNORE_ADVICE, process_group
    )
    with torch.no_grad():
        _zero_unless(groups, keep_by_norm(total, max_norm), foreach)
    return total


def grad_ignore_value_(
    parameters: TensorOrTensors | FlatGrads,
    clip_value: float | Tensor,
    foreach: bool | None = None,
    *,
    process_group: torch.distributed.ProcessGroup | None = None,
) -> Tensor:
    r"""Zero *every* gradient when any single entry reaches ``clip_value``.

    .. math::
        m = \max_{i,j} |g_{ij}| = \|g\|_\infty, \qquad
        \text{keep} \iff m < \text{clip\_value} .

    A NaN entry makes ``m`` NaN and an infinite one makes it inf; ``m < clip_value``
    is false for both, so they are ignored. The comparison is made in float64, so the
    threshold is not rounded to the gradients' precision first. Zeroing is not
    skipping; see :func:`grad_ignore_norm_`. To clamp instead, see
    :func:`clip_grad_value_`.

    Args:
        parameters (Tensor or Iterable[Tensor]): tensors whose ``.grad`` may be zeroed in
            place; tensors without a gradient are skipped. An empty generator warns.
        clip_value (float or Tensor): the smallest absolute entry that triggers the
            ignore, a non-negative number, or a 0-dim tensor, used on the device as it
            is (unchecked).
        foreach (bool, optional): see :func:`get_total_norm` (used for the maximum and the
            zeroing). Default: None
        process_group (ProcessGroup, optional): the group whose ranks hold different
            pieces of the gradients: pipeline stages (torchtitan's ``pp_mesh.get_group()``),
            or tensors sharded by hand; the largest entry is then that of all the pieces,
            the same bits on every rank. DTensors are reduced over their own mesh first: a
            group sharing ranks with their mesh is refused (ValueError). ``None``: this
            rank's plain tensors as they are. Default: None

    Returns:
        Tensor: the largest absolute gradient entry before the decision, 0-dim
        (``tensor(0.)`` when there are no gradients); over all ranks, with
        ``process_group`` or DTensor gradients.

    .. note::
        No host read.

    .. note::
        With ``process_group``, or DTensor gradients, the call issues collectives
        (one or two all-reduces of a few numbers, no host read): call it on every
        rank of the group, with gradients of the same dtypes. The maximum is reduced with a NaN
        flag, so a NaN on one rank zeroes every rank's gradients.
    """
    clip_value = check_threshold_or_tensor("clip_value", clip_value)
    grads = _grads_of(parameters, "ignoring")
    groups, largest = _norm_of_grads(grads, math.inf, False, foreach, "", process_group)
    with torch.no_grad():
        _zero_unless(groups, keep_by_value(largest, clip_value), foreach)
    return largest
