r"""Clip or ignore: the four gradient-control functions and the total-norm helper.

``clip_grad_norm_`` and ``clip_grad_value_`` reproduce :mod:`torch.nn.utils`;
``grad_ignore_norm_`` and ``grad_ignore_value_`` zero the *whole* gradient instead
of rescaling it when it is too large or not finite, so that a bad batch contributes
nothing to the update.

Every function

* accepts a tensor or any iterable of tensors (a generator such as
  ``model.parameters()`` included) and skips tensors whose ``.grad`` is ``None``;
* groups gradients by device and dtype and uses torch's ``_foreach`` kernels where
  the device supports them;
* never reads a tensor's value on the host (no device-to-host synchronisation),
  except for the check that ``error_if_nonfinite=True`` asks for;
* validates its arguments before touching any gradient.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.utils._foreach_utils import (
    _device_has_foreach_support,
    _group_tensors_by_device_and_dtype,
    _has_foreach_support,
)

__all__ = [
    "clip_grad_norm_",
    "clip_grad_value_",
    "get_total_norm",
    "grad_ignore_norm_",
    "grad_ignore_value_",
]

TensorOrTensors = Tensor | Iterable[Tensor]

#: Added to the total norm before dividing, exactly as ``torch.nn.utils`` does, so
#: that a zero gradient gives a finite coefficient instead of ``max_norm / 0``.
EPS = 1e-6

_LOW_PRECISION = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- checks


def _check_threshold(name: str, value: object) -> float:
    """Return ``value`` as a float, or raise ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative number (inf allowed), got {value!r}")
    return value


def _check_norm_type(norm_type: object) -> float:
    """Return ``norm_type`` as a float p in (0, inf], or raise ValueError."""
    if isinstance(norm_type, str):
        if norm_type.strip().lower() not in ("inf", "+inf", "infinity"):
            raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}")
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise ValueError(
            f"norm_type must be a positive number or 'inf', got {type(norm_type).__name__}"
        )
    p = float(norm_type)
    if math.isnan(p) or p <= 0:
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}")
    return p


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_foreach(foreach: object) -> None:
    if foreach is not None and not isinstance(foreach, bool):
        raise ValueError(f"foreach must be None, True or False, got {foreach!r}")


def _as_tensor_list(tensors: TensorOrTensors, name: str) -> list[Tensor]:
    """Materialise ``tensors`` (a tensor or an iterable, generators included) as a list."""
    if isinstance(tensors, Tensor):
        return [tensors]
    try:
        items = list(tensors)
    except TypeError:
        raise ValueError(
            f"{name} must be a tensor or an iterable of tensors, got {type(tensors).__name__}"
        ) from None
    for item in items:
        if not isinstance(item, Tensor):
            raise ValueError(
                f"{name} must contain only tensors, found {type(item).__name__} {item!r}"
            )
    return items


def _grads_of(parameters: TensorOrTensors) -> list[Tensor]:
    """The gradients of ``parameters`` that exist, in order."""
    params = _as_tensor_list(parameters, "parameters")
    return [g for p in params if (g := p.grad) is not None]


# ------------------------------------------------------------------- device groups


def _groups(tensors: list[Tensor]) -> list[tuple[torch.device, torch.dtype, list[Tensor]]]:
    """Split ``tensors`` into (device, dtype, tensors) groups, keeping every tensor once."""
    if not tensors:  # torch's grouping helper rejects an empty list
        return []
    grouped = _group_tensors_by_device_and_dtype([tensors])
    return [
        (device, dtype, device_tensors)
        for (device, dtype), ([device_tensors], _) in grouped.items()
    ]


def _use_foreach(tensors: list[Tensor], device: torch.device, foreach: bool | None) -> bool:
    """Decide, as ``torch.nn.utils`` does, whether a group takes the foreach path."""
    if foreach is None:
        return _has_foreach_support(tensors, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(
            f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
        )
    return foreach


def _accumulation_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """float64 if any input is float64, else float32: never accumulate in 16 bits."""
    return torch.float64 if torch.float64 in set(dtypes) else torch.float32


# ---------------------------------------------------------------------- total norm


#: From this many entries on, a CPU tensor's max |entry| is taken with aminmax.
_AMINMAX_MIN_NUMEL = 1024


def _max_abs_on_cpu(group: list[Tensor], use_foreach: bool, dtype: torch.dtype) -> Tensor:
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
        if use_foreach:
            norms = torch._foreach_norm(small, math.inf, dtype=dtype)
        else:
            norms = [torch.linalg.vector_norm(g, math.inf, dtype=dtype) for g in small]
        pieces.append(torch.stack(norms))
    if large:
        lows, highs = zip(*(torch.aminmax(g) for g in large), strict=True)
        pieces.append(torch.maximum(torch.stack(highs), torch.stack(lows).neg()).to(dtype))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _total_norm(
    tensors: list[Tensor],
    p: float,
    foreach: bool | None,
    groups: list[tuple[torch.device, torch.dtype, list[Tensor]]] | None = None,
) -> Tensor:
    r"""The p-norm of ``tensors`` viewed as one vector (no argument checks).

    Uses :math:`\|g\|_p = \bigl\|(\|g_1\|_p, \dots, \|g_k\|_p)\bigr\|_p`: the norm of
    the per-tensor norms, so no concatenated copy is ever made. ``groups`` may pass
    in ``_groups(tensors)`` when the caller needs them again afterwards. The vector
    of per-tensor norms is the one torch builds (same values, same order), so the
    result is bit-for-bit torch's wherever torch computes the same per-tensor norms.
    """
    if not tensors:
        return torch.tensor(0.0)
    first_device = tensors[0].device
    if groups is None:
        groups = _groups(tensors)
    acc_dtype = _accumulation_dtype(dtype for _, dtype, _ in groups)
    pieces: list[Tensor] = []  # one 1-D tensor of per-tensor norms per group
    for device, dtype, group in groups:
        if p == math.inf:
            # The max over no entries is 0 (every norm is >= 0), but torch's kernels
            # refuse to reduce an empty tensor with max: leave empty ones out.
            group = [g for g in group if g.numel() > 0]
            if not group:
                continue
        # float32/float64 keep torch's exact kernel call; 16-bit inputs are reduced
        # in float32, where a norm of a few hundred large entries cannot overflow.
        norm_dtype = torch.float32 if dtype in _LOW_PRECISION else None
        use_foreach = _use_foreach(group, device, foreach)
        if p == math.inf and device.type == "cpu" and dtype.is_floating_point:
            piece = _max_abs_on_cpu(group, use_foreach, norm_dtype or dtype)
        elif use_foreach:
            piece = torch.stack(torch._foreach_norm(group, p, dtype=norm_dtype))
        else:
            piece = torch.stack([torch.linalg.vector_norm(g, p, dtype=norm_dtype) for g in group])
        # One .to() per group (a no-op when nothing changes), not one per tensor.
        pieces.append(piece.to(device=first_device, dtype=acc_dtype))
    if not pieces:  # only empty tensors and the inf-norm
        return torch.zeros((), dtype=acc_dtype, device=first_device)
    per_tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return torch.linalg.vector_norm(per_tensor, p)


def _raise_if_nonfinite(total_norm: Tensor, p: float) -> None:
    value = total_norm.item()  # the one host read the caller asked for
    if not math.isfinite(value):
        raise RuntimeError(
            f"The total norm of order {p} of the gradients is non-finite ({value}). "
            "Pass error_if_nonfinite=False to clip or ignore it anyway."
        )


def get_total_norm(
    tensors: TensorOrTensors,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    r"""The p-norm of a collection of tensors viewed as one concatenated vector.

    .. math::
        \|g\|_p = \Bigl(\sum_i \sum_j |g_{ij}|^p\Bigr)^{1/p}
               = \bigl\|(\|g_1\|_p, \ldots, \|g_k\|_p)\bigr\|_p,
        \qquad \|g\|_\infty = \max_{i,j} |g_{ij}|.

    Args:
        tensors: a tensor or an iterable of tensors (these are the values whose norm
            is taken, typically gradients, not parameters).
        norm_type: p, a positive number, or ``math.inf`` / ``'inf'`` for the max-norm.
        error_if_nonfinite: raise RuntimeError if the norm is NaN or infinite.
        foreach: ``None`` picks the foreach kernels where the device supports them;
            ``True`` demands them (RuntimeError where unsupported); ``False`` loops.

    Returns:
        A 0-dim tensor on the first tensor's device: the total norm, in float32
        (float64 if any input is float64), so float16 and bfloat16 inputs do not
        overflow. ``tensor(0.)`` when there are no tensors.

    Raises:
        ValueError: ``norm_type`` is not a positive number or inf.
        RuntimeError: ``error_if_nonfinite`` is set and the norm is not finite.
    """
    p = _check_norm_type(norm_type)
    _check_flag("error_if_nonfinite", error_if_nonfinite)
    _check_foreach(foreach)
    tensors = _as_tensor_list(tensors, "tensors")
    with torch.no_grad():
        total = _total_norm(tensors, p, foreach)
    if error_if_nonfinite:
        _raise_if_nonfinite(total, p)
    return total


# ------------------------------------------------------------------------ clipping


def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    r"""Rescale all gradients together so that their total norm is at most ``max_norm``.

    .. math::
        c = \min\Bigl(1, \frac{\text{max\_norm}}{\|g\|_p + 10^{-6}}\Bigr),
        \qquad g \leftarrow c\, g .

    The direction of the whole gradient is kept. The coefficient is clamped and always
    multiplied, never branched on, so the decision stays on the device. Same
    gradients and return value as :func:`torch.nn.utils.clip_grad_norm_` (16-bit
    gradients get a float32 norm). A non-finite norm wrecks the gradient: a NaN norm
    makes every entry NaN, and an infinite one gives ``max_norm / inf = 0``, which
    zeroes the finite entries and turns the infinite ones into NaN (``inf * 0``); use
    :func:`grad_ignore_norm_`, or ``error_if_nonfinite=True``, to guard against that.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is rescaled
            in place; tensors without a gradient are skipped.
        max_norm: the largest total norm allowed, a non-negative number.
        norm_type: p, a positive number, or ``math.inf`` / ``'inf'``.
        error_if_nonfinite: raise RuntimeError, before any gradient changes, if the
            total norm is NaN or infinite.
        foreach: see :func:`get_total_norm`.

    Returns:
        The total norm of the gradients *before* clipping, a 0-dim tensor.
    """
    max_norm = _check_threshold("max_norm", max_norm)
    p = _check_norm_type(norm_type)
    _check_flag("error_if_nonfinite", error_if_nonfinite)
    _check_foreach(foreach)
    grads = _grads_of(parameters)
    with torch.no_grad():
        groups = _groups(grads)
        total = _total_norm(grads, p, foreach, groups)
        if error_if_nonfinite:
            _raise_if_nonfinite(total, p)
        coef = torch.clamp(max_norm / (total + EPS), max=1.0)
        for device, _, group in groups:
            coef_here = coef.to(device)
            if _use_foreach(group, device, foreach):
                torch._foreach_mul_(group, coef_here)
            else:
                for g in group:
                    g.mul_(coef_here)
    return total


def clip_grad_value_(
    parameters: TensorOrTensors,
    clip_value: float,
    foreach: bool | None = None,
) -> None:
    r"""Clamp every gradient entry into ``[-clip_value, clip_value]``.

    .. math::
        g_{ij} \leftarrow \min\bigl(\max(g_{ij}, -\text{clip\_value}), \text{clip\_value}\bigr)

    Each entry is clamped on its own, so the direction of the gradient generally
    changes. Same gradients as :func:`torch.nn.utils.clip_grad_value_` (a NaN entry
    stays NaN).

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clamped in
            place; tensors without a gradient are skipped.
        clip_value: the largest absolute value allowed, a non-negative number.
        foreach: see :func:`get_total_norm`.

    Returns:
        None. (It does not return a norm, whatever some tutorials say.)
    """
    clip_value = _check_threshold("clip_value", clip_value)
    _check_foreach(foreach)
    grads = _grads_of(parameters)
    with torch.no_grad():
        for device, _, group in _groups(grads):
            if _use_foreach(group, device, foreach):
                torch._foreach_clamp_min_(group, -clip_value)
                torch._foreach_clamp_max_(group, clip_value)
            else:
                for g in group:
                    g.clamp_(min=-clip_value, max=clip_value)


# ------------------------------------------------------------------------ ignoring


#: A signed integer type of each float width, used to select a whole tensor's bits.
_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _zero_unless(
    groups: list[tuple[torch.device, torch.dtype, list[Tensor]]],
    keep: Tensor,
    foreach: bool | None,
) -> None:
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
        int_dtype = _SAME_WIDTH_INT.get(dtype.itemsize) if dtype.is_floating_point else None
        if int_dtype is None:  # complex gradients, say: select tensor by tensor
            keep_here = keep.to(device)
            zero = torch.zeros((), dtype=dtype, device=device)
            for g in group:
                torch.where(keep_here, g, zero, out=g)
            continue
        factor = keep.to(device=device, dtype=int_dtype)
        bits = [g.view(int_dtype) for g in group]
        if _use_foreach(group, device, foreach):
            torch._foreach_mul_(bits, factor)
        else:
            for b in bits:
                b.mul_(factor)


def grad_ignore_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    r"""Zero *every* gradient when their total norm is too large or not finite.

    .. math::
        \text{keep} \iff \frac{\text{max\_norm}}{\|g\|_p + 10^{-6}} \ge 1,
        \qquad g \leftarrow \begin{cases} g & \text{keep} \\ 0 & \text{otherwise.} \end{cases}

    The comparison is written so that a NaN norm fails it (every comparison with NaN
    is false), and an infinite norm gives ``max_norm / inf = 0 < 1``: both are ignored
    and leave zeros, never NaN. Kept gradients are untouched bit for bit. The test
    matches :func:`clip_grad_norm_`: a gradient is ignored exactly when clipping
    would have rescaled it.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` may be zeroed
            in place; tensors without a gradient are skipped.
        max_norm: the largest total norm kept, a non-negative number.
        norm_type: p, a positive number, or ``math.inf`` / ``'inf'``.
        error_if_nonfinite: raise RuntimeError, before any gradient changes, if the
            total norm is NaN or infinite.
        foreach: see :func:`get_total_norm` (used for the norm and the zeroing).

    Returns:
        The total norm of the gradients before the decision, a 0-dim tensor.
    """
    max_norm = _check_threshold("max_norm", max_norm)
    p = _check_norm_type(norm_type)
    _check_flag("error_if_nonfinite", error_if_nonfinite)
    _check_foreach(foreach)
    grads = _grads_of(parameters)
    with torch.no_grad():
        groups = _groups(grads)
        total = _total_norm(grads, p, foreach, groups)
        if error_if_nonfinite:
            _raise_if_nonfinite(total, p)
        keep = max_norm / (total + EPS) >= 1.0
        _zero_unless(groups, keep, foreach)
    return total


def grad_ignore_value_(
    parameters: TensorOrTensors,
    clip_value: float,
    foreach: bool | None = None,
) -> Tensor:
    r"""Zero *every* gradient when any single entry reaches ``clip_value``.

    .. math::
        m = \max_{i,j} |g_{ij}| = \|g\|_\infty, \qquad
        \text{keep} \iff m < \text{clip\_value} .

    A NaN entry makes ``m`` NaN and an infinite one makes it inf; ``m < clip_value``
    is false for both, so they are ignored. The comparison is made in float64, so the
    threshold is not rounded to the gradients' precision first.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` may be zeroed
            in place; tensors without a gradient are skipped.
        clip_value: the smallest absolute entry that triggers the ignore.
        foreach: see :func:`get_total_norm` (used for the maximum and the zeroing).

    Returns:
        The largest absolute gradient entry before the decision, a 0-dim tensor
        (``tensor(0.)`` when there are no gradients).
    """
    clip_value = _check_threshold("clip_value", clip_value)
    _check_foreach(foreach)
    grads = _grads_of(parameters)
    with torch.no_grad():
        groups = _groups(grads)
        largest = _total_norm(grads, math.inf, foreach, groups)
        keep = largest.to(torch.float64) < clip_value
        _zero_unless(groups, keep, foreach)
    return largest
