r"""The device-side transaction of ``StepGuard(sync=False)`` for optimizers without ``found_inf``.

Before ``optimizer.step()``: copy every tensor the step can change into buffers kept from
step to step. After it: keep the new or the old value of each tensor with a select on a
0-dim mask, so that the decision never leaves the device. When the step changed the
*structure* of what it touches (a new state entry, a Python number, a list that grew),
a select cannot undo it: :meth:`Transaction.commit` then reads the decision on the host
and, on a skip, puts back every container and tensor as it was.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradlab.clip import _SAME_WIDTH_INT

__all__ = ["Transaction"]

# A captured value: ("T", tensor, leaf index), ("D", dict, {key: node}),
# ("L", list, [node]), ("U", tuple type, [node]) or ("V", value).
_Node = tuple[Any, ...]


class Transaction:
    """Snapshot, step, then select or restore, for one optimizer.

    The snapshot covers the parameters that have a gradient (the only ones a
    torch.optim step changes), their state (tensors nested in lists, tuples and dicts
    included) and every param group's non-``params`` entries.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._leaves: list[Tensor] = []  # the live tensors the buffers were made for
        self._buffers: list[Tensor] = []
        self._by_device: list[tuple[list[Tensor], list[Tensor]]] = []

    @property
    def buffers(self) -> list[Tensor]:
        """The snapshot buffers (allocated once, reused while the tensors stay the same)."""
        return self._buffers

    def run(self, params: list[Tensor], keep: Tensor, step: Any) -> tuple[Any, bool]:
        """``step()``, then leave everything as before it unless ``keep``.

        Call under :func:`torch.no_grad`.

        Returns:
            ``step()``'s return value, and whether ``keep`` had to be read on the host.
        """
        opt = self._optimizer
        leaves: list[Tensor] = list(params)
        n_state = len(opt.state)
        state = {p: _capture(opt.state[p], leaves) for p in params if p in opt.state}
        groups = [
            {k: _capture(v, leaves) for k, v in g.items() if k != "params"}
            for g in opt.param_groups
        ]
        self._copy_into_buffers(leaves)
        try:
            output = step()
        except BaseException:
            self._restore(params, state, groups)
            raise
        buffers = self._buffers
        pairs = [(p, b) for p, b in zip(params, buffers, strict=False)]
        same = len(opt.state) == n_state and all(p in opt.state for p in state)
        same = same and all(_match(n, opt.state[p], buffers, pairs) for p, n in state.items())
        same = same and all(
            g.keys() - {"params"} == before.keys()
            and all(_match(n, g[k], buffers, pairs) for k, n in before.items())
            for g, before in zip(opt.param_groups, groups, strict=True)
        )
        if same:
            masks: dict[tuple[torch.device, torch.dtype], Tensor] = {}
            for live, old in pairs:
                _select_(live, old, keep, masks)
            return output, False
        if not bool(keep.item()):  # the one host read: a select cannot undo a new structure
            self._restore(params, state, groups)
        return output, True

    def _copy_into_buffers(self, leaves: list[Tensor]) -> None:
        if len(leaves) != len(self._leaves) or any(
            a is not b for a, b in zip(leaves, self._leaves, strict=True)
        ):
            self._leaves = leaves
            self._buffers = [
                torch.empty_like(t, memory_format=torch.contiguous_format) for t in leaves
            ]
            groups: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
            for t, b in zip(leaves, self._buffers, strict=True):
                pair = groups.setdefault(t.device, ([], []))
                pair[0].append(t)
                pair[1].append(b)
            self._by_device = list(groups.values())
        for tensors, buffers in self._by_device:
            torch._foreach_copy_(buffers, tensors)

    def _restore(
        self,
        params: list[Tensor],
        state: dict[Tensor, _Node],
        groups: list[dict[str, _Node]],
    ) -> None:
        """Put back every container and tensor as it was before the step (same objects)."""
        opt = self._optimizer
        for p, old in zip(params, self._buffers, strict=False):
            p.copy_(old)
        for p in [p for p in params if p in opt.state and p not in state]:
            del opt.state[p]
        for p, node in state.items():
            opt.state[p] = _put_back(node, self._buffers)
        for g, before in zip(opt.param_groups, groups, strict=True):
            for key in [k for k in g if k != "params" and k not in before]:
                del g[key]
            g.update({k: _put_back(node, self._buffers) for k, node in before.items()})


def _capture(value: Any, leaves: list[Tensor]) -> _Node:
    if isinstance(value, Tensor):
        if value.layout != torch.strided:
            raise ValueError(
                f"StepGuard(sync=False) cannot snapshot a {value.layout} tensor in the "
                "optimizer's state or param groups; use sync=True"
            )
        leaves.append(value)
        return ("T", value, len(leaves) - 1)
    if isinstance(value, dict):
        return ("D", value, {k: _capture(v, leaves) for k, v in value.items()})
    if isinstance(value, list):
        return ("L", value, [_capture(v, leaves) for v in value])
    if isinstance(value, tuple):
        return ("U", type(value), [_capture(v, leaves) for v in value])
    return ("V", value)


def _match(
    node: _Node, value: Any, buffers: list[Tensor], pairs: list[tuple[Tensor, Tensor]]
) -> bool:
    """Whether a select can carry ``node`` to ``value``; collects (live, old) tensor pairs."""
    kind = node[0]
    if kind == "T":
        old = node[1]
        if not (
            isinstance(value, Tensor)
            and value.shape == old.shape
            and value.dtype == old.dtype
            and value.device == old.device
            and value.layout == torch.strided
        ):
            return False
        pairs.append((value, buffers[node[2]]))
        return True
    if kind == "D":
        return (
            isinstance(value, dict)
            and value.keys() == node[2].keys()
            and all(_match(n, value[k], buffers, pairs) for k, n in node[2].items())
        )
    if kind in ("L", "U"):
        expected = list if kind == "L" else node[1]
        return (
            type(value) is expected
            and len(value) == len(node[2])
            and all(_match(n, v, buffers, pairs) for n, v in zip(node[2], value, strict=True))
        )
    old = node[1]
    if value is old:
        return True
    if isinstance(value, Tensor) or type(value) is not type(old):
        return False
    try:
        return bool(value == old)
    except Exception:  # an exotic value without a boolean ==: treat it as changed
        return False


def _put_back(node: _Node, buffers: list[Tensor]) -> Any:
    kind = node[0]
    if kind == "T":
        node[1].copy_(buffers[node[2]])
        return node[1]
    if kind == "D":
        node[1].clear()
        node[1].update({k: _put_back(n, buffers) for k, n in node[2].items()})
        return node[1]
    if kind == "L":
        node[1][:] = [_put_back(n, buffers) for n in node[2]]
        return node[1]
    if kind == "U":
        return node[1](_put_back(n, buffers) for n in node[2])
    return node[1]


def _select_(
    live: Tensor, old: Tensor, keep: Tensor, masks: dict[tuple[torch.device, torch.dtype], Tensor]
) -> None:
    r"""``live <- live if keep else old``, in place, on the device, bit for bit.

    Done on the bits, :math:`x \leftarrow (x_{\text{new}} \wedge M) \vee
    (x_{\text{old}} \wedge \lnot M)` with :math:`M` all ones (keep) or all zeros: exact
    for NaN payloads and signed zeros, and three vectorised in-place passes, several
    times faster on CPU than ``torch.where`` with a broadcast 0-dim condition (used
    where a bit view is impossible). ``old`` is overwritten.
    """
    bits = _SAME_WIDTH_INT.get(live.element_size())
    if bits is None or not (live.is_contiguous() and old.is_contiguous()) or live.is_complex():
        torch.where(keep.to(live.device), live, old, out=live)
        return
    key = (live.device, bits)
    if key not in masks:
        masks[key] = keep.to(device=live.device, dtype=bits).neg()  # 0 or all ones
    mask = masks[key]
    live_bits, old_bits = live.view(bits), old.view(bits)
    live_bits.bitwise_and_(mask)
    old_bits.bitwise_and_(mask.bitwise_not())
    live_bits.bitwise_or_(old_bits)
