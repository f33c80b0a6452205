r"""An exact skip of an optimizer step: :func:`step_if_`.

Zeroing the gradients is not skipping. Plug :math:`g_t = 0` into the update rules:

.. math::
    \text{SGD, momentum } \mu,\ \text{weight decay } \lambda:\quad
        b_t = \mu b_{t-1} + \lambda\theta_{t-1}, \qquad \theta_t = \theta_{t-1} - \eta b_t

    \text{Adam:}\quad m_t = \beta_1 m_{t-1}, \quad v_t = \beta_2 v_{t-1}, \quad t \leftarrow t + 1,
        \qquad \theta_t = \theta_{t-1}
        - \eta\,\frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}

    \text{AdamW:}\quad \text{as Adam, and } \theta \leftarrow (1 - \eta\lambda)\,\theta
        \text{ as well.}

The parameters keep moving on momentum, the moment estimates decay, the step count (and
with it the bias correction) advances and weight decay still shrinks the weights.
:func:`step_if_` instead leaves every parameter, every optimizer-state tensor, the step
counts and the param groups bit for bit as if the batch had never been seen, and fires
no step hook, whenever its ``keep`` is false.

It is the second phase of a two-phase step, as :func:`gradlab.clip_grads_with_norm_`
is of clipping: measure, decide on the device, then step or not::

    norm = gradlab.get_total_norm(grads)                       # phase 1: measure
    keep = gradlab.keep_by_norm(norm, 1.0) & (loss < 10)       # any rule, on the device
    gradlab.step_if_(optimizer, keep, sync=False)              # phase 2: exact skip

Three ways to skip exactly:

``sync=True``
    Read ``keep`` on the host (one read, as :class:`torch.amp.GradScaler` reads its
    ``found_inf``) and call ``optimizer.step()`` only if it is true.

``sync=False``, fused optimizer
    Adam, AdamW, SGD and Adagrad with ``fused=True`` skip inside their kernel when their
    ``found_inf`` attribute is a nonzero tensor: the protocol GradScaler uses. As
    GradScaler does, ``found_inf`` is set for the call and removed after it. No copy,
    no read.

``sync=False``, any other optimizer
    Copy what the step can change, step, then keep the new or the old value of every
    tensor with a device-side select. The copy buffers are made once per optimizer and
    reused (one copy of the stepped parameters and their state), and freed with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import optimizer as _optim_module

from gradlab import distributed
from gradlab._common import SAME_WIDTH_INT, check_flag, check_keep, select_bits_

__all__ = ["step_if_"]


def step_if_(
    optimizer: torch.optim.Optimizer,
    keep: Tensor | bool,
    closure: Callable[[], Any] | None = None,
    *,
    sync: bool = True,
) -> Any:
    r"""``optimizer.step(closure)`` if ``keep`` is true; otherwise leave no trace at all.

    .. math::
        (\theta, s) \leftarrow \begin{cases} \text{step}(\theta, s, g) & \text{keep} \\
        (\theta, s) & \text{otherwise} \end{cases}

    where :math:`s` is the whole optimizer state. When ``keep`` is false the parameters,
    every state tensor (nested ones and Adam's ``step`` included), the step counts and
    the param groups are left as if the call had never been made, state entries a
    first step would create are not created, and no step hook fires. The gradients are
    not touched either way.

    ``keep`` may come from any rule: :func:`gradlab.keep_by_norm`, a loss test, a norm
    reduced over a process group (FSDP, TP), a custom statistic. With many ranks, pass
    every rank the same ``keep`` (a reduced norm gives one; otherwise
    :func:`gradlab.distributed.all_reduce_keep`).

    Args:
        optimizer (torch.optim.Optimizer): the optimizer to step.
        keep (Tensor or bool): a 0-dim ``torch.bool`` tensor on any device, or a Python
            bool (then nothing is read).
        closure (Callable, optional): passed to ``optimizer.step`` (LBFGS). It is not
            called when the step is skipped with ``sync=True``. Default: None
        sync (bool): ``True``: read ``keep`` on the host once and step only if it is
            true. ``False``: never read it where the optimizer allows (see the notes).
            Default: True

    Returns:
        What ``optimizer.step`` returned; ``None`` if it was not called.

    Raises:
        TypeError: ``optimizer`` is not a :class:`torch.optim.Optimizer`.
        ValueError: ``keep`` is not a 0-dim bool tensor or a bool; ``closure`` is not
            callable; ``sync`` is not a bool; a sparse optimizer or sparse state with
            ``sync=False``. Checked before anything changes.

    .. note::
        Host reads: ``sync=True``, one (none for a Python bool). ``sync=False``, none for
        a fused optimizer, and none on the snapshot path for torch's other optimizers,
        except in a step that creates optimizer state (the first), a step that changes
        the state's structure (LBFGS's lists), and every step while step hooks are
        registered: those read ``keep`` once, since only not stepping skips host code.
        The optimizers' own reads (their CPU ``step`` tensors) come on top, as without
        a skip.

    .. note::
        Memory: nothing for ``sync=True`` and fused optimizers; on the snapshot path one
        copy of the stepped parameters and their state, made at the first call and
        reused while they stay the same tensors.

    .. note::
        Under :func:`torch.compile` this call runs eagerly (a graph break, as a plain
        ``optimizer.step()`` is unless compiled on its own): it sets and removes
        ``found_inf`` on the optimizer, and it may read ``keep``. The decision before it
        (the norm and the rule) compiles into one graph.
    """
    if torch.compiler.is_compiling():
        return _step_if_eagerly(optimizer, keep, closure, sync=sync)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    keep = check_keep(keep)
    if closure is not None and not callable(closure):
        raise ValueError(f"closure must be callable or None, got {type(closure).__name__}")
    check_flag("sync", sync)
    if isinstance(keep, bool):
        return _step(optimizer, closure) if keep else None
    parts = _parts(optimizer)
    if sync or any(_has_user_step_hooks(o) for o in (optimizer, *parts)):
        return _step(optimizer, closure) if bool(keep) else None  # hooks are host code
    if all(_honours_found_inf(o) for o in parts):
        return _fused_step_if(optimizer, parts, keep, closure)
    if any(isinstance(o, torch.optim.SparseAdam) for o in parts):
        raise ValueError(
            "step_if_(sync=False) cannot snapshot SparseAdam's sparse state; use sync=True"
        )
    snapshots = [_snapshot_of(o) for o in parts]
    return _snapshot_step_if(snapshots, keep, lambda: _step(optimizer, closure))


#: step_if_ as a graph break: under torch.compile it runs eagerly (it sets attributes on
#: the optimizer and may read ``keep``). Only there: in eager mode the wrapper around a
#: fused step costs more than setting found_inf does.
_step_if_eagerly = torch.compiler.disable(step_if_)


def _step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> Any:
    return optimizer.step() if closure is None else optimizer.step(closure)


def mark_internal_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a step pre-hook of the library's own (a guard's check that every step comes
    through it), which a skip need not avoid: it is not a reason to read ``keep``."""
    hook.gradlab_internal = True  # type: ignore[attr-defined]
    return hook


def _has_user_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    # getattr: a wrapper that never ran Optimizer.__init__ (Accelerate's) has no hooks
    pre = [
        h
        for h in getattr(optimizer, "_optimizer_step_pre_hooks", {}).values()
        if not getattr(h, "gradlab_internal", False)
    ]
    return bool(
        pre
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or _optim_module._global_optimizer_pre_hooks
        or _optim_module._global_optimizer_post_hooks
    )


def _parts(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers whose state a step of ``optimizer`` changes.

    A container that steps several optimizers and keeps no state of its own (torchtitan's
    ``OptimizersContainer``, one optimizer per model part) lists them in ``.optimizers``;
    any other optimizer is its own part.
    """
    inner = getattr(optimizer, "optimizers", None)
    if (
        isinstance(inner, list | tuple)
        and inner
        and all(isinstance(o, torch.optim.Optimizer) and o is not optimizer for o in inner)
    ):
        return [part for o in inner for part in _parts(o)]
    return [optimizer]


#: torch.optim's optimizers whose fused kernels skip a step when found_inf is nonzero.
_FUSED_FOUND_INF = (torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad)


def _honours_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step of ``optimizer`` skips itself when its ``found_inf`` is set.

    torch marks it (``_step_supports_amp_scaling``) when ``fused=True`` is a default; an
    optimizer made with ``fused`` in every param group (as torchtitan builds them) runs
    the same kernels.
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return True
    return (
        isinstance(optimizer, _FUSED_FOUND_INF)
        and bool(optimizer.param_groups)
        and all(g.get("fused") for g in optimizer.param_groups)
    )


def _stepped_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The parameters a torch.optim step can change: those with a gradient."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


#: Each optimizer seen with state for every parameter: (id of its state dict, the dict's
#: length, its parameter count) then. While the three stay so, a step creates no state and
#: the walk over the parameters is skipped (thousands of tensors: a look-up each).
_COMPLETE: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int, int]] = (
    weakref.WeakKeyDictionary()
)


def _completeness(optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    state = optimizer.state
    return id(state), len(state), sum(len(g["params"]) for g in optimizer.param_groups)


def _fresh_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The parameters a step of ``optimizer`` would give state for the first time."""
    if _COMPLETE.get(optimizer) == _completeness(optimizer):
        return []
    # opt.state is a defaultdict: an entry read before the first step is empty.
    return [p for p in _stepped_params(optimizer) if not optimizer.state.get(p)]


def _note_completeness(optimizer: torch.optim.Optimizer) -> None:
    """Remember ``optimizer`` as complete if every parameter has non-empty state (a
    state dict as long as the parameters, checked once, not at every step)."""
    key = _completeness(optimizer)
    if _COMPLETE.get(optimizer) != key and key[1] == key[2] and all(optimizer.state.values()):
        _COMPLETE[optimizer] = key


def _fused_step_if(
    optimizer: torch.optim.Optimizer,
    parts: list[torch.optim.Optimizer],
    keep: Tensor,
    closure: Callable[[], Any] | None,
) -> Any:
    """Step with ``found_inf`` set from ``keep`` on every fused part, for this call only.

    The fused kernels leave the parameters and moments alone when ``found_inf`` is
    nonzero and undo their own ``step += 1``. A first step still creates state entries,
    which only the host can remove: that step reads ``keep``.
    """
    fresh = [(o, p) for o in parts for p in _fresh_params(o)]
    previous = [o.__dict__.get("found_inf", _MISSING) for o in parts]
    for o in parts:
        flag = _found_inf_flag(o, keep.device)
        torch.logical_not(keep, out=flag)  # one kernel, into a tensor made once
        # The attribute GradScaler sets (torch's fused optimizers read it with getattr).
        setattr(o, "found_inf", flag)  # noqa: B010
    try:
        output = _step(optimizer, closure)
    finally:
        for o, before in zip(parts, previous, strict=True):
            if before is _MISSING:
                delattr(o, "found_inf")
            else:
                setattr(o, "found_inf", before)  # noqa: B010
    created = [(o, p) for o, p in fresh if o.state.get(p)]
    if created and not bool(keep):
        for o, p in created:
            del o.state[p]
    for o in parts:
        _note_completeness(o)
    return output


_MISSING = object()

#: Each fused optimizer's found_inf flag, a 0-dim float32 tensor per device, made once and
#: freed with the optimizer. A new tensor at every step costs several times more than the
#: kernel that fills it (measured on a CPU: 18-30 µs against 2 µs, per step).
_FLAGS: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[torch.device, Tensor]] = (
    weakref.WeakKeyDictionary()
)


def _found_inf_flag(optimizer: torch.optim.Optimizer, device: torch.device) -> Tensor:
    flags = _FLAGS.setdefault(optimizer, {})
    flag = flags.get(device)
    if flag is None:
        flag = flags[device] = torch.zeros((), dtype=torch.float32, device=device)
    return flag


# ----------------------------------------------------------------------- snapshot

#: The snapshot of each optimizer that takes the snapshot path, freed with it.
_SNAPSHOTS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Snapshot] = (
    weakref.WeakKeyDictionary()
)


def _snapshot_of(optimizer: torch.optim.Optimizer) -> _Snapshot:
    snapshot = _SNAPSHOTS.get(optimizer)
    if snapshot is None:
        snapshot = _SNAPSHOTS[optimizer] = _Snapshot(optimizer)
    return snapshot


def snapshot_buffers(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The copy buffers :func:`step_if_` holds for ``optimizer`` (empty if none).

    For measuring what the snapshot path costs in memory.
    """
    snapshot = _SNAPSHOTS.get(optimizer)
    return [] if snapshot is None else list(snapshot.buffers)


class _Captured:
    """What one snapshot recorded before a step: the tensors and the containers."""

    __slots__ = ("groups", "n_state", "params", "state")

    def __init__(
        self,
        params: list[Tensor],
        state: dict[Tensor, _Node],
        groups: list[dict[str, _Node]],
        n_state: int,
    ) -> None:
        self.params, self.state, self.groups, self.n_state = params, state, groups, n_state


class _Snapshot:
    """Copy before a step, then select or restore after it, for one optimizer.

    The copy covers the parameters that have a gradient (the only ones a torch.optim
    step changes), their state (tensors nested in lists, tuples and dicts included) and
    every param group's entries but ``params``. Captured values are :class:`_Leaf`
    (a tensor, by its index among the copied tensors), :class:`_Mapping`,
    :class:`_Sequence` and :class:`_Value` nodes. A DTensor (FSDP2) is copied and
    selected through its local shard, which is where its values are.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._leaves: list[Tensor] = []  # the live tensors the buffers were made for
        self.buffers: list[Tensor] = []
        self._by_device: list[tuple[list[Tensor], list[Tensor]]] = []

    def capture(self) -> _Captured:
        """Record the containers and copy every tensor the step can change."""
        opt = self._optimizer
        params = _stepped_params(opt)
        # The parameters come first among the copied tensors, so buffers[i] is the copy
        # of params[i] for every i < len(params).
        leaves: list[Tensor] = list(params)
        state = {p: _capture(opt.state[p], leaves) for p in params if p in opt.state}
        groups = [
            {k: _capture(v, leaves) for k, v in g.items() if k != "params"}
            for g in opt.param_groups
        ]
        self._copy(leaves)
        return _Captured(params, state, groups, len(opt.state))

    def pairs_if_same(self, captured: _Captured) -> list[tuple[Tensor, Tensor]] | None:
        """(live, copy) for every tensor, if the step kept every container as it was (so
        that a select can undo it); None if it changed one."""
        opt, buffers = self._optimizer, self.buffers
        pairs = list(zip(captured.params, buffers, strict=False))
        if len(opt.state) != captured.n_state or any(p not in opt.state for p in captured.state):
            return None
        for p, node in captured.state.items():
            if not _match(node, opt.state[p], buffers, pairs):
                return None
        for g, before in zip(opt.param_groups, captured.groups, strict=True):
            if g.keys() - {"params"} != before.keys():
                return None
            if not all(_match(node, g[k], buffers, pairs) for k, node in before.items()):
                return None
        return pairs

    def _copy(self, leaves: list[Tensor]) -> None:
        if len(leaves) != len(self._leaves) or any(
            a is not b for a, b in zip(leaves, self._leaves, strict=True)
        ):
            self._leaves = leaves
            self.buffers = [
                torch.empty_like(_local(t), memory_format=torch.contiguous_format) for t in leaves
            ]
            groups: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
            for t, b in zip(leaves, self.buffers, strict=True):
                pair = groups.setdefault(b.device, ([], []))
                pair[0].append(_local(t))
                pair[1].append(b)
            self._by_device = list(groups.values())
        for tensors, buffers in self._by_device:
            torch._foreach_copy_(buffers, tensors)

    def restore(self, captured: _Captured) -> None:
        """Put back every container and tensor as it was before the step (same objects)."""
        opt = self._optimizer
        for p, old in zip(captured.params, self.buffers, strict=False):
            _local(p).copy_(old)
        for p in [p for p in captured.params if p in opt.state and p not in captured.state]:
            del opt.state[p]
        for p, node in captured.state.items():
            opt.state[p] = node.put_back(self.buffers)
        for g, before in zip(opt.param_groups, captured.groups, strict=True):
            for key in [k for k in g if k != "params" and k not in before]:
                del g[key]
            g.update({k: node.put_back(self.buffers) for k, node in before.items()})


def _snapshot_step_if(snapshots: list[_Snapshot], keep: Tensor, step: Callable[[], Any]) -> Any:
    """``step()``, then leave every snapshotted optimizer as before it unless ``keep``."""
    with torch.no_grad():
        captured = [s.capture() for s in snapshots]
        try:
            output = step()
        except BaseException:
            for s, c in zip(snapshots, captured, strict=True):
                s.restore(c)
            raise
        pairs = [s.pairs_if_same(c) for s, c in zip(snapshots, captured, strict=True)]
        if all(p is not None for p in pairs):
            masks: dict[tuple[torch.device, torch.dtype], Tensor] = {}
            for live, old in (pair for part in pairs for pair in part or ()):
                local = _local(live)
                select_bits_(local, old, keep, _mask(masks, keep, local))
        elif not bool(keep):  # the one host read: a select cannot undo a new structure
            for s, c in zip(snapshots, captured, strict=True):
                s.restore(c)
    return output


def _local(t: Tensor) -> Tensor:
    """A DTensor's local shard (a view: writes reach the DTensor), any other tensor."""
    return distributed.local_tensors([t])[0]


def _mask(masks: dict[tuple[torch.device, torch.dtype], Tensor], keep: Tensor, live: Tensor):
    """``keep`` as all-zero or all-one integers of ``live``'s width, made once per kind."""
    bits = SAME_WIDTH_INT.get(live.element_size())
    if bits is None:
        return None
    key = (live.device, bits)
    if key not in masks:
        masks[key] = keep.to(device=live.device, dtype=bits).neg()
    return masks[key]


class _Leaf:
    __slots__ = ("index", "tensor")

    def __init__(self, tensor: Tensor, index: int) -> None:
        self.tensor, self.index = tensor, index

    def put_back(self, buffers: list[Tensor]) -> Tensor:
        _local(self.tensor).copy_(buffers[self.index])
        return self.tensor


class _Mapping:
    __slots__ = ("items", "mapping")

    def __init__(self, mapping: dict, items: dict[Any, _Node]) -> None:
        self.mapping, self.items = mapping, items

    def put_back(self, buffers: list[Tensor]) -> dict:
        restored = {k: n.put_back(buffers) for k, n in self.items.items()}
        self.mapping.clear()
        self.mapping.update(restored)
        return self.mapping


class _Sequence:
    __slots__ = ("items", "kind", "original")

    def __init__(self, original: list | tuple, items: list[_Node]) -> None:
        self.original, self.kind, self.items = original, type(original), items

    def put_back(self, buffers: list[Tensor]) -> list | tuple:
        restored = [n.put_back(buffers) for n in self.items]
        if self.kind is list:
            self.original[:] = restored  # type: ignore[index]
            return self.original
        return self.kind(restored)


class _Value:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def put_back(self, buffers: list[Tensor]) -> Any:
        return self.value


_Node = _Leaf | _Mapping | _Sequence | _Value


def _capture(value: Any, leaves: list[Tensor]) -> _Node:
    if isinstance(value, Tensor):
        if value.layout != torch.strided:
            raise ValueError(
                f"step_if_(sync=False) cannot snapshot a {value.layout} tensor in the "
                "optimizer's state or param groups; use sync=True"
            )
        leaves.append(value)
        return _Leaf(value, len(leaves) - 1)
    if isinstance(value, dict):
        return _Mapping(value, {k: _capture(v, leaves) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return _Sequence(value, [_capture(v, leaves) for v in value])
    return _Value(value)


def _match(
    node: _Node, value: Any, buffers: list[Tensor], pairs: list[tuple[Tensor, Tensor]]
) -> bool:
    """Whether a select can carry ``node`` to ``value``; collects (live, old) tensor pairs."""
    if isinstance(node, _Leaf):
        old = node.tensor
        if not (
            isinstance(value, Tensor)
            and value.shape == old.shape
            and value.dtype == old.dtype
            and value.device == old.device
            and value.layout == torch.strided
        ):
            return False
        pairs.append((value, buffers[node.index]))
        return True
    if isinstance(node, _Mapping):
        return (
            isinstance(value, dict)
            and value.keys() == node.items.keys()
            and all(_match(n, value[k], buffers, pairs) for k, n in node.items.items())
        )
    if isinstance(node, _Sequence):
        return (
            type(value) is node.kind
            and len(value) == len(node.items)
            and all(_match(n, v, buffers, pairs) for n, v in zip(node.items, value, strict=True))
        )
    old = node.value
    if value is old:
        return True
    if isinstance(value, Tensor) or type(value) is not type(old):
        return False
    try:
        return bool(value == old)
    except Exception:  # an exotic value without a boolean ==: treat it as changed
        return False
