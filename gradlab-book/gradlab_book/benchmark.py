r"""What the book times, and the baselines it times against; no clock of its own.

The timing itself is done by ``benchmarks/harness.py``, the one harness of the
benchmarks (thread CPU time, interleaved rounds, ratios min/min and paired), and the
chapter on costs quotes every speed from the JSON that ``benchmarks/bench_clip.py`` and
``benchmarks/bench_flat.py`` stored in ``gradlab_book/data/``. What lives here is what
both the benchmark and a live cell of the chapter need, so that they time the same
calls:

* :func:`make_parameters` builds a seeded set of float32 parameters with gradients,
  ``n_tensors`` of them holding ``n_elements`` numbers in all;
* :func:`loop_ignore_norm_` and :func:`loop_ignore_value_` restate the per-tensor
  loop algorithm of the reference walk-through (norms of each tensor stacked, then a
  Python ``if`` on a tensor, which reads it on the host); the only change is that
  ``inf`` comes from :mod:`math`, as ``torch._six`` no longer exists;
* :func:`floor_norm` is the one-pass floor: a single
  :func:`torch.linalg.vector_norm` over one flat tensor of the same total size;
* :data:`IMPLEMENTATIONS` names the calls that the chapter counts and the benchmark
  times, each on a list of parameters, with thresholds above every gradient (nothing is
  clipped or ignored, so that each repeat does the work of a healthy step).

Example::

    from gradlab_book.benchmark import IMPLEMENTATIONS, make_parameters
    params = make_parameters(100, 1_000_000)
    IMPLEMENTATIONS["gradlab clip norm, foreach=True"](params)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

import gradlab

__all__ = [
    "HUGE",
    "IMPLEMENTATIONS",
    "floor_norm",
    "loop_ignore_norm_",
    "loop_ignore_value_",
    "make_parameters",
]

#: A threshold far above any gradient of :func:`make_parameters`: every call keeps the
#: gradients as they are, so each repeat does the same work.
HUGE = 1e30


def make_parameters(
    n_tensors: int,
    n_elements: int,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> list[torch.nn.Parameter]:
    """``n_tensors`` float32 parameters holding ``n_elements`` numbers in all.

    The sizes differ by at most one (the first ``n_elements % n_tensors`` tensors get
    one more), so every tensor holds at least one number when ``n_elements >=
    n_tensors``. Each parameter's ``.grad`` is standard normal noise from a
    ``torch.Generator`` seeded with ``seed``: the same call gives the same gradients.

    Args:
        n_tensors (int): how many parameters, at least 1.
        n_elements (int): how many numbers in all, at least 0.
        device (str or torch.device): where the parameters live. Default: ``"cpu"``
        seed (int): the seed of the gradients. Default: 0

    Returns:
        list[torch.nn.Parameter]: the parameters, each with a ``.grad``.

    Raises:
        ValueError: if ``n_tensors < 1`` or ``n_elements < 0``.
    """
    if n_tensors < 1 or n_elements < 0:
        raise ValueError(
            f"need n_tensors >= 1 and n_elements >= 0, got n_tensors={n_tensors}, "
            f"n_elements={n_elements}"
        )
    generator = torch.Generator().manual_seed(seed)
    base, extra = divmod(n_elements, n_tensors)
    params = []
    for i in range(n_tensors):
        size = base + (1 if i < extra else 0)
        param = torch.nn.Parameter(torch.zeros(size, device=device))
        # Drawn on the CPU so that every device gets the same numbers.
        param.grad = torch.randn(size, generator=generator).to(device)
        params.append(param)
    return params


# ------------------------------------------------------- the reference loop algorithm


def _with_grads(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    return [p for p in parameters if p.grad is not None]


def loop_ignore_norm_(
    parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0
) -> Tensor:
    """Ignore-by-norm as the reference walk-through computes it, for timing only.

    One norm per tensor, the norms stacked and normed again, then a Python ``if`` on
    the 0-dim coefficient tensor, which copies it to the host (a device sync), and a
    ``zero_()`` per tensor when it is below 1. Like the original it raises
    IndexError on an empty list and lets a NaN norm through (``NaN < 1`` is false).
    Use :func:`gradlab.grad_ignore_norm_` for real work.

    Args:
        parameters (Tensor or Iterable[Tensor]): the parameters.
        max_norm (float): the threshold.
        norm_type (float): the p of the norm. Default: 2.0

    Returns:
        Tensor: the total norm (0-dim).

    .. note::
        Reads the host once per call (the ``if``).
    """
    params = _with_grads(parameters)
    max_norm, norm_type = float(max_norm), float(norm_type)
    device = params[0].grad.device
    if norm_type == math.inf:
        per_tensor = [p.grad.detach().abs().max().to(device) for p in params]
        total = per_tensor[0] if len(per_tensor) == 1 else torch.stack(per_tensor).max()
    else:
        per_tensor = [torch.norm(p.grad.detach(), norm_type).to(device) for p in params]
        total = torch.norm(torch.stack(per_tensor), norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1:  # a tensor in a Python `if`: the host waits for the device here
        for p in params:
            p.grad.zero_()
    return total


def loop_ignore_value_(parameters: Tensor | Iterable[Tensor], clip_value: float) -> None:
    """Ignore-by-value as the reference walk-through computes it, for timing only.

    The largest absolute entry of each tensor in turn, compared on the host with
    ``clip_value`` (one device sync per tensor until one reaches it), then a
    ``zero_()`` per tensor if one did. Use :func:`gradlab.grad_ignore_value_` for
    real work.

    Args:
        parameters (Tensor or Iterable[Tensor]): the parameters.
        clip_value (float): the threshold on the largest absolute entry.

    Returns:
        None

    .. note::
        Reads the host once per tensor, up to the first that reaches ``clip_value``.
    """
    params = _with_grads(parameters)
    clip_value = float(clip_value)
    too_large = False
    for p in params:
        if p.grad.abs().max() >= clip_value:  # host read, once per tensor
            too_large = True
            break
    if too_large:
        for p in params:
            p.grad.zero_()


def floor_norm(flat: Tensor, norm_type: float = 2.0) -> Tensor:
    """The one-pass floor: one :func:`torch.linalg.vector_norm` over one flat tensor.

    Any total-norm computation must read every number at least once; this does it in
    one kernel, with no per-tensor work. It is the floor of torch's norm kernel, not of
    the memory: while the numbers sit in the cache, one thread's norm is bound by its
    arithmetic, and a plain ``flat.sum()`` is faster (``benchmarks/bench_clip.py``
    times both). Pass a flat tensor with as many numbers as the parameter set.

    Args:
        flat (Tensor): the numbers, in one tensor.
        norm_type (float): the p of the norm. Default: 2.0

    Returns:
        Tensor: the norm (0-dim).

    .. note::
        No host read.
    """
    return torch.linalg.vector_norm(flat, norm_type)


def _ignore(foreach: bool) -> Callable[[list[Tensor]], object]:
    return lambda ps: gradlab.grad_ignore_norm_(ps, HUGE, foreach=foreach)


def _clip(foreach: bool) -> Callable[[list[Tensor]], object]:
    return lambda ps: gradlab.clip_grad_norm_(ps, HUGE, foreach=foreach)


def _torch_clip(foreach: bool) -> Callable[[list[Tensor]], object]:
    return lambda ps: torch.nn.utils.clip_grad_norm_(ps, HUGE, foreach=foreach)


#: What each counted and timed implementation runs on a list of parameters.
IMPLEMENTATIONS: dict[str, Callable[[list[Tensor]], object]] = {
    "reference loop, ignore norm": lambda ps: loop_ignore_norm_(ps, HUGE),
    "reference loop, ignore value": lambda ps: loop_ignore_value_(ps, HUGE),
    "gradlab ignore norm, foreach=False": _ignore(False),
    "gradlab ignore norm, foreach=True": _ignore(True),
    "gradlab clip norm, foreach=False": _clip(False),
    "gradlab clip norm, foreach=True": _clip(True),
    "torch clip norm, foreach=False": _torch_clip(False),
    "torch clip norm, foreach=True": _torch_clip(True),
}
