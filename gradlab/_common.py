"""What the library's modules share: argument checks, device groups and the bit select.

The module is private to the library (its name starts with an underscore), and its
names are not: each one is the single definition that ``clip``, ``step``, ``guard``,
``accumulation``, ``adaptive``, ``per_sample`` and ``distributed`` call. Every check
raises :class:`ValueError` (or :class:`RuntimeError` for a missing process group) that
names the argument, and runs before anything changes.
"""

from __future__ import annotations

import functools
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
    "EPS",
    "PLAIN_TYPES",
    "SAME_WIDTH_INT",
    "Groups",
    "TensorOrTensors",
    "Threshold",
    "as_tensor_list",
    "check_flag",
    "check_foreach",
    "check_int",
    "check_keep",
    "check_norm_type",
    "check_process_group",
    "check_real",
    "check_threshold",
    "check_threshold_or_tensor",
    "constant",
    "device_groups",
    "select_bits_",
    "use_foreach",
]

TensorOrTensors = Tensor | Iterable[Tensor]
Threshold = float | Tensor
Groups = list[tuple[torch.device, torch.dtype, list[Tensor]]]

#: Added to a norm before dividing by it, exactly as ``torch.nn.utils`` does, so that a
#: zero gradient gives a finite coefficient instead of ``max_norm / 0``.
EPS = 1e-6

#: Tensors of these types are plain; any other (a DTensor) takes the distributed path.
PLAIN_TYPES = (Tensor, torch.nn.Parameter)

#: A signed integer type of each float width: a float tensor viewed as these integers
#: (no copy) can be selected bit for bit, NaN payloads and signed zeros included.
SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# --------------------------------------------------------------------------- checks


def _real_as_float(name: str, value: object) -> float:
    """``value`` as a float if it is a real number (not a bool), or ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float: {value!r}") from None


def check_threshold(name: str, value: object) -> float:
    """``value`` as a float >= 0 (inf allowed), or ValueError naming ``name``."""
    value = _real_as_float(name, value)
    if not value >= 0:  # NaN fails it too; one comparison, which compile can guard on
        raise ValueError(f"{name} must be a non-negative number (inf allowed), got {value!r}")
    return value


def check_threshold_or_tensor(name: str, value: object) -> Threshold:
    """A number (checked as by :func:`check_threshold`) or a 0-dim real tensor, as it is."""
    if not isinstance(value, Tensor):
        return check_threshold(name, value)
    if value.dim() != 0 or value.dtype == torch.bool or value.is_complex():
        raise ValueError(
            f"{name} given as a tensor must be a 0-dim real tensor, "
            f"got shape {tuple(value.shape)} and dtype {value.dtype}"
        )
    return value


def check_keep(keep: object) -> Tensor | bool:
    """``keep`` if it is a bool or a 0-dim bool tensor (the form of every skip decision)."""
    if isinstance(keep, bool):
        return keep
    if not (isinstance(keep, Tensor) and keep.dim() == 0 and keep.dtype == torch.bool):
        shape = tuple(keep.shape) if isinstance(keep, Tensor) else None
        dtype = keep.dtype if isinstance(keep, Tensor) else type(keep).__name__
        raise ValueError(
            "keep must be a 0-dim torch.bool tensor (such as gradlab.keep_by_norm returns) "
            f"or a bool, got {dtype} of shape {shape}"
        )
    return keep


def check_norm_type(norm_type: object) -> float:
    """``norm_type`` as a float p in (0, inf], or ValueError."""
    if isinstance(norm_type, str):
        if norm_type.strip().lower() not in ("inf", "+inf", "infinity"):
            raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}")
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise ValueError(
            f"norm_type must be a positive number or 'inf', got {type(norm_type).__name__}"
        )
    try:
        p = float(norm_type)
    except OverflowError:
        raise ValueError(
            f"norm_type is too large for a float: {norm_type!r} (use math.inf for the max norm)"
        ) from None
    if not p > 0:  # NaN fails it too
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}")
    return p


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is a bool, or ValueError."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_foreach(foreach: object) -> bool | None:
    """``foreach`` if it is None, True or False, or ValueError."""
    if foreach is not None and not isinstance(foreach, bool):
        raise ValueError(f"foreach must be None, True or False, got {foreach!r}")
    return foreach


def check_int(name: str, value: object, low: int) -> int:
    """``value`` as an int >= ``low`` (a bool is refused), or ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_real(
    name: str, value: object, low: float, high: float = math.inf, *, open_low: bool = False
) -> float:
    """``value`` as a float in [low, high] ((low, high] with ``open_low``), or ValueError."""
    value = _real_as_float(name, value)
    too_low = value <= low if open_low else value < low
    if math.isnan(value) or too_low or value > high:
        bracket = "(" if open_low else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value!r}")
    return value


def check_process_group(process_group: object) -> None:
    if process_group is None:
        return
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "process_group was given, but torch.distributed is not initialized "
            "(call torch.distributed.init_process_group first)"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(
            "process_group must be None or a torch.distributed.ProcessGroup, "
            f"got {type(process_group).__name__}"
        )


def as_tensor_list(tensors: TensorOrTensors, name: str) -> list[Tensor]:
    """``tensors`` (a tensor or an iterable, generators included) as a list, checked."""
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


# -------------------------------------------------------------------- device groups


def device_groups(tensors: list[Tensor]) -> Groups:
    """Split ``tensors`` into (device, dtype, tensors) groups, keeping every tensor once."""
    if not tensors:  # torch's grouping helper rejects an empty list
        return []
    grouped = _group_tensors_by_device_and_dtype([list(tensors)])
    return [
        (device, dtype, [t for t in device_tensors if t is not None])
        for (device, dtype), ([device_tensors], _) in grouped.items()
    ]


def use_foreach(tensors: list[Tensor], device: torch.device, foreach: bool | None) -> bool:
    """Decide, as ``torch.nn.utils`` does, whether a group takes the foreach path."""
    if foreach is None:
        return _has_foreach_support(tensors, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(
            f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
        )
    return foreach


@functools.lru_cache(maxsize=1024)
def constant(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-dim tensor of ``value``, made once per (value, dtype, device); never write it.

    Why: a Python number in an op becomes a new wrapped tensor at every call (a few
    microseconds on a CPU), and a tensor made from a host value copies it (on a GPU, a
    wait); ``torch.full`` fills on the device instead.
    """
    return torch.full((), value, dtype=dtype, device=device)


# ----------------------------------------------------------------------- bit select


def select_bits_(live: Tensor, old: Tensor, keep: Tensor, mask: Tensor | None = None) -> None:
    r"""``live <- live if keep else old``, in place, on the device, bit for bit.

    Done on the bits, :math:`x \leftarrow (x_{\text{new}} \wedge M) \vee
    (x_{\text{old}} \wedge \lnot M)` with :math:`M` all ones (keep) or all zeros: exact
    for NaN payloads and signed zeros, and three vectorised in-place passes, several
    times faster on a CPU than ``torch.where`` with a broadcast 0-dim condition (used
    where a bit view is impossible). ``old`` is overwritten. ``mask``, if given, is
    ``keep`` as that integer type, negated (0 or all ones), made once per device and
    width by the caller.
    """
    bits = SAME_WIDTH_INT.get(live.element_size())
    if bits is None or not (live.is_contiguous() and old.is_contiguous()) or live.is_complex():
        torch.where(keep.to(live.device), live, old, out=live)
        return
    if mask is None:
        mask = keep.to(device=live.device, dtype=bits).neg()
    live_bits, old_bits = live.view(bits), old.view(bits)
    live_bits.bitwise_and_(mask)
    old_bits.bitwise_and_(mask.bitwise_not())
    live_bits.bitwise_or_(old_bits)
