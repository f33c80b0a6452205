r"""A true step skip: a bad batch leaves no trace in the parameters or the optimizer.

Zeroing the gradients is not skipping. Plug :math:`g_t = 0` into the update rules:

.. math::
    \text{SGD, momentum } \mu,\ \text{weight decay } \lambda:\quad
        b_t = \mu b_{t-1} + \lambda\theta_{t-1}, \qquad \theta_t = \theta_{t-1} - \eta b_t

    \text{Adam:}\quad m_t = \beta_1 m_{t-1}, \quad v_t = \beta_2 v_{t-1}, \quad t \leftarrow t + 1,
        \qquad \theta_t = \theta_{t-1}
        - \eta\,\frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}

    \text{AdamW:}\quad \text{as Adam, and } \theta \leftarrow (1 - \eta\lambda)\,\theta
        \text{ as well.}

The parameters keep moving on momentum, the moment estimates decay, the step count
(and with it the bias correction) advances and weight decay still shrinks the
weights. :class:`StepGuard` instead leaves every parameter and every optimizer-state
tensor bit for bit as if the batch had never been seen, and does not advance the
learning-rate scheduler either.

Two ways to skip exactly:

``sync=True``
    Read the decision on the host (one device-to-host synchronisation per step, as
    :class:`torch.amp.GradScaler` does with ``found_inf``) and simply do not call
    ``optimizer.step()``. Costs one pass over the gradients (two when clipping) and no
    extra memory.

``sync=False``
    Never wait for the device: copy the parameters and the optimizer state, run the
    step unconditionally, then keep the old or the new value of every tensor with a
    device-side select, ``torch.where(keep, new, old)`` on a 0-dim mask (done on the
    bits, see :func:`_select_`). Works for any optimizer, but keeps one extra copy of
    the parameters and the optimizer state (buffers reused from step to step; for
    Adam three times the parameter memory) and makes about two extra passes over
    them (the copy, and the select).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from gradlab.clip import (
    _SAME_WIDTH_INT,
    EPS,
    _check_norm_type,
    _check_threshold,
    clip_grad_norm_,
    clip_grad_value_,
    get_total_norm,
)

__all__ = ["DECISIONS", "StepGuard", "StepRecord"]

#: The decisions a :class:`StepGuard` records, indexed by their device-side code.
DECISIONS = ("kept", "clipped", "skipped")
_KEPT, _CLIPPED, _SKIPPED = 0, 1, 2

_MODES = ("none", "clip", "ignore")
_BY = ("norm", "value")


# ------------------------------------------------------------------------- records


class StepRecord:
    """What a :class:`StepGuard` saw and did at one call of :meth:`StepGuard.step`.

    Behaves like the tuple ``(step, total_norm, decision)`` (it unpacks and compares
    like one).

    Attributes:
        step: the index of the call, 0 for the first ``guard.step()`` (skipped
            calls included), so it equals the batch index of an ``enumerate`` loop.
        total_norm: the statistic the decision was based on, as a float: the total
            ``norm_type``-norm of the gradients (``by="norm"``) or their largest
            absolute entry (``by="value"``), before any clipping. May be ``nan`` or
            ``inf``.
        decision: ``"kept"`` (stepped unchanged), ``"clipped"`` (clipped, then
            stepped) or ``"skipped"`` (no trace left).

    ``total_norm`` and ``decision`` may be held as 0-dim device tensors until they
    are first read, so that recording a step never forces a synchronisation.
    """

    __slots__ = ("_decision", "_norm", "step")

    def __init__(self, step: int, total_norm: float | Tensor, decision: str | Tensor) -> None:
        if isinstance(decision, str) and decision not in DECISIONS:
            raise ValueError(f"decision must be one of {DECISIONS}, got {decision!r}")
        self.step = int(step)
        self._norm: float | Tensor = (
            total_norm.detach() if isinstance(total_norm, Tensor) else float(total_norm)
        )
        self._decision: str | Tensor = decision

    @property
    def pending(self) -> bool:
        """True while a field is still a device tensor that has not been read."""
        return isinstance(self._norm, Tensor) or isinstance(self._decision, Tensor)

    @property
    def total_norm(self) -> float:
        if isinstance(self._norm, Tensor):
            _resolve([self])
        return self._norm  # type: ignore[return-value]

    @property
    def decision(self) -> str:
        if isinstance(self._decision, Tensor):
            _resolve([self])
        return self._decision  # type: ignore[return-value]

    @property
    def skipped(self) -> bool:
        return self.decision == "skipped"

    def __iter__(self) -> Iterator[Any]:
        return iter((self.step, self.total_norm, self.decision))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepRecord | tuple):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"StepRecord(step={self.step}, total_norm={self.total_norm:.6g}, "
            f"decision={self.decision!r})"
        )


def _resolve(records: list[StepRecord]) -> None:
    """Read every pending field of ``records`` with one transfer per device."""
    slots: dict[torch.device, list[tuple[StepRecord, str, Tensor]]] = {}
    for record in records:
        for name in ("_norm", "_decision"):
            value = getattr(record, name)
            if isinstance(value, Tensor):
                slots.setdefault(value.device, []).append((record, name, value))
    for entries in slots.values():
        values = torch.stack([t.to(torch.float64) for _, _, t in entries]).tolist()
        for (record, name, _), value in zip(entries, values, strict=True):
            if name == "_norm":
                record._norm = value
            else:
                record._decision = DECISIONS[int(value)]


# --------------------------------------------------------------------------- guard


class StepGuard:
    r"""Take, clip or skip each optimizer step, depending on the gradients.

    .. code-block:: python

        guard = StepGuard(optimizer, mode="ignore", threshold=1.0)
        for x, y in batches:
            loss_fn(model(x), y).backward()
            record = guard.step()          # StepRecord(step, total_norm, decision)
            guard.zero_grad(set_to_none=True)

    The statistic :math:`s` is the total norm :math:`\|g\|_p` of all the optimizer's
    gradients (``by="norm"``) or their largest absolute entry
    :math:`\|g\|_\infty` (``by="value"``). A step is *over* the threshold
    :math:`\tau` by the same rules as :func:`gradlab.grad_ignore_norm_` and
    :func:`gradlab.grad_ignore_value_`:

    .. math::
        \text{by norm: } \frac{\tau}{s + 10^{-6}} < 1, \qquad
        \text{by value: } s \ge \tau .

    ``mode``:

    * ``"none"``: record :math:`s`, always step (NaN included): a baseline.
    * ``"clip"``: clip with :func:`gradlab.clip_grad_norm_` (by norm) or
      :func:`gradlab.clip_grad_value_` (by value), then step; the decision is
      ``"clipped"`` when over the threshold. A non-finite :math:`s` is skipped, never
      stepped (clipping a NaN gradient would give NaN).
    * ``"ignore"``: skip the whole step exactly when over the threshold or when
      :math:`s` is NaN or infinite.

    A skipped step leaves every parameter, every optimizer-state tensor (Adam's
    ``step`` included) and the scheduler exactly as if the batch had never been
    seen. NaN and Inf never reach them (except with ``mode="none"``). The gradients
    themselves are not restored: in ``"clip"`` mode they may already be clipped when
    the step is skipped; zero them before the next backward pass as usual.

    Cost per step, for P parameter entries, S optimizer-state entries (S = 2P for
    Adam) and G gradient entries:

    =========  =====================================  =============  ================
    ``sync``   passes over the data                   extra memory   host syncs
    =========  =====================================  =============  ================
    True       1 over G (norm); +1 to clip            none           1 (the decision)
    False      as above, + copy of P+S, + select      P + S          0 (steady state)
    =========  =====================================  =============  ================

    With ``sync=False`` the select cannot add or remove dictionary entries or change
    a Python number, so the guard reads the decision on the host (once) in a step
    where the optimizer changes the *structure* of its state: the first step that
    creates a parameter's state, or an optimizer keeping Python numbers in its state.
    torch.optim optimizers keep only tensors, so from their second step on there is
    no synchronisation at all. On a GPU, a state tensor on another device than the
    gradients (non-capturable Adam keeps ``step`` on the CPU) needs the mask copied
    there, which waits for the GPU: use ``fused=True`` or ``capturable=True``.

    Args:
        optimizer: the :class:`torch.optim.Optimizer` to guard; its parameters with a
            ``.grad`` are the ones measured.
        mode: ``"none"``, ``"clip"`` or ``"ignore"`` (see above).
        by: ``"norm"`` or ``"value"``.
        threshold: :math:`\tau`, a non-negative number (``inf`` allowed).
        norm_type: p of the total norm, a positive number or ``inf`` (``by="norm"``).
        scheduler: an optional learning-rate scheduler of this same optimizer,
            stepped right after every step that is taken and never on a skipped one.
            Only with ``sync=True``: with ``sync=False`` the decision stays on the
            device, and a scheduler's ``step()`` is host code (it sets the Python
            float ``group["lr"]``), so it could not be made conditional without the
            very synchronisation ``sync=False`` avoids.
        sync: ``True`` to decide on the host, ``False`` for the device-side select.

    Raises:
        TypeError: ``optimizer`` is not a :class:`torch.optim.Optimizer`.
        ValueError: a bad ``mode``, ``by``, ``threshold``, ``norm_type``, ``sync`` or
            ``scheduler`` (another optimizer's, one needing a metric, or any with
            ``sync=False``).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        mode: str = "ignore",
        by: str = "norm",
        threshold: float = 1.0,
        norm_type: float | str = 2.0,
        scheduler: Any = None,
        sync: bool = True,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not isinstance(mode, str) or mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if not isinstance(by, str) or by not in _BY:
            raise ValueError(f"by must be one of {_BY}, got {by!r}")
        if not isinstance(sync, bool):
            raise ValueError(f"sync must be True or False, got {sync!r}")
        self._optimizer = optimizer
        self.mode = mode
        self.by = by
        self.threshold = _check_threshold("threshold", threshold)
        self.norm_type = _check_norm_type(norm_type)
        self.sync = sync
        if scheduler is not None:
            _check_scheduler(scheduler, optimizer, sync)
        self._scheduler = scheduler
        self._records: list[StepRecord] = []
        self._steps = 0
        # sync=False: the snapshot buffers, and the tensors they were made for.
        self._buffers: list[Tensor] = []
        self._buffered: list[Tensor] = []

    # ------------------------------------------------------------------ properties

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def scheduler(self) -> Any:
        return self._scheduler

    @property
    def history(self) -> list[StepRecord]:
        """Every step's record, oldest first (pending device values are read now)."""
        _resolve([r for r in self._records if r.pending])
        return list(self._records)

    @property
    def skipped(self) -> int:
        """How many steps were skipped so far."""
        return sum(r.decision == "skipped" for r in self.history)

    @property
    def num_steps(self) -> int:
        """How many times :meth:`step` was called (skipped steps included)."""
        return self._steps

    def __repr__(self) -> str:
        return (
            f"StepGuard({type(self._optimizer).__name__}, mode={self.mode!r}, by={self.by!r}, "
            f"threshold={self.threshold:g}, norm_type={self.norm_type:g}, sync={self.sync})"
        )

    # ------------------------------------------------------------------------ step

    def step(self) -> StepRecord:
        """Measure the gradients, then take, clip or skip the optimizer step.

        Returns:
            The :class:`StepRecord` of this step (also appended to :attr:`history`).

        Raises:
            RuntimeError: no parameter of the optimizer has a gradient.
        """
        params = [
            p
            for group in self._optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if not params:
            raise RuntimeError(
                "StepGuard.step() found no gradient: no parameter of the optimizer has a "
                ".grad. Call loss.backward() before guard.step()."
            )
        with torch.no_grad():
            stat, code = self._measure(params)
        index = self._steps
        self._steps += 1
        if self.mode == "none":
            self._take_step()
            record = StepRecord(index, stat, "kept")
        elif self.sync:
            decision = DECISIONS[int(code.item())]  # the one host read of the step
            if decision != "skipped":
                self._take_step()
            record = StepRecord(index, stat, decision)
        else:
            with torch.no_grad():
                self._step_and_select(code != _SKIPPED)
            record = StepRecord(index, stat, code)
        self._records.append(record)
        return record

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad(set_to_none)``."""
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def _take_step(self) -> None:
        self._optimizer.step()
        if self._scheduler is not None:
            self._scheduler.step()

    def _measure(self, params: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The statistic and the decision code (0 kept, 1 clipped, 2 skipped), on the device.

        In ``"clip"`` mode the gradients are clipped here, unconditionally.
        """
        if self.by == "norm":
            if self.mode == "clip":
                stat = clip_grad_norm_(params, self.threshold, self.norm_type)
            else:
                stat = get_total_norm([p.grad for p in params], self.norm_type)
            # Written so that NaN fails the test, as in grad_ignore_norm_.
            within = self.threshold / (stat + EPS) >= 1.0
        else:
            stat = get_total_norm([p.grad for p in params], math.inf)
            within = stat.to(torch.float64) < self.threshold
            if self.mode == "clip":
                clip_grad_value_(params, self.threshold)
        bad = ~torch.isfinite(stat)
        if self.mode == "ignore":
            code = (~within | bad).to(torch.int64) * _SKIPPED
        else:  # "clip" ("none" ignores the code)
            code = (~within).to(torch.int64).masked_fill(bad, _SKIPPED)
        return stat, code

    def _step_and_select(self, keep: Tensor) -> None:
        """Step, then keep the new or the old value of every tensor, on the device."""
        opt = self._optimizer
        params = [p for group in opt.param_groups for p in group["params"]]
        state_before = {p: dict(entry) for p, entry in opt.state.items()}
        live = [p.detach() for p in params] + [
            v.detach()
            for entry in state_before.values()
            for v in entry.values()
            if isinstance(v, Tensor)
        ]
        copies = self._snapshot(live)
        param_copies = copies[: len(params)]
        rest = iter(copies[len(params) :])
        state_copies = {
            p: {k: next(rest) for k, v in entry.items() if isinstance(v, Tensor)}
            for p, entry in state_before.items()
        }
        groups_before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]

        opt.step()

        if not _same_structure(opt, state_before, groups_before):
            # A select cannot undo a new dict entry or a Python number: read the
            # decision once (torch.optim: only on the step that creates the state).
            if not bool(keep.item()):
                _restore(opt, params, param_copies, state_before, state_copies, groups_before)
            return
        masks: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        for p, old in zip(params, param_copies, strict=True):
            _select_(p.detach(), old, keep, masks)
        for p, copies in state_copies.items():
            entry = opt.state[p]
            for key, old in copies.items():
                _select_(entry[key].detach(), old, keep, masks)

    def _snapshot(self, live: list[Tensor]) -> list[Tensor]:
        """Copies of ``live`` in buffers kept from step to step.

        Reusing the buffers avoids allocating (and, on CPU, page-faulting) fresh
        memory at every step; they are reallocated only when the set of tensors
        changes (in practice: after the step that creates the optimizer state).
        """
        reuse = len(self._buffers) == len(live) and all(
            a is b for a, b in zip(self._buffered, live, strict=True)
        )
        if not reuse:
            self._buffered = list(live)
            self._buffers = [
                torch.empty_like(t, memory_format=torch.contiguous_format) for t in live
            ]
        for device_live, device_buffers in _by_device(live, self._buffers):
            torch._foreach_copy_(device_buffers, device_live)
        return self._buffers

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's and the scheduler's state dicts, and the history."""
        return {
            "optimizer": self._optimizer.state_dict(),
            "scheduler": None if self._scheduler is None else self._scheduler.state_dict(),
            "history": [tuple(r) for r in self.history],
            "num_steps": self._steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (into this guard's optimizer and scheduler)."""
        if (state_dict["scheduler"] is None) != (self._scheduler is None):
            raise ValueError(
                "scheduler: the state dict was saved "
                f"{'without' if state_dict['scheduler'] is None else 'with'} a scheduler, "
                f"this guard has {'none' if self._scheduler is None else 'one'}"
            )
        self._optimizer.load_state_dict(state_dict["optimizer"])
        if self._scheduler is not None:
            self._scheduler.load_state_dict(state_dict["scheduler"])
        self._records = [StepRecord(*entry) for entry in state_dict["history"]]
        self._steps = int(state_dict.get("num_steps", len(self._records)))


# ------------------------------------------------------------------------- helpers


def _check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer, sync: bool) -> None:
    if not sync:
        raise ValueError(
            "scheduler cannot be used with sync=False: the skip decision stays on the "
            "device, and scheduler.step() is host code that would have to read it (a "
            "synchronisation). Use sync=True, or step the scheduler yourself."
        )
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "scheduler: ReduceLROnPlateau needs a metric in step(metrics); step it "
            "yourself when record.decision != 'skipped'"
        )
    if not callable(getattr(scheduler, "step", None)):
        raise ValueError(f"scheduler must have a step() method, got {type(scheduler).__name__}")
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise ValueError(
            "scheduler belongs to a different optimizer than the one guarded; its "
            "learning rates would not be the ones used"
        )


def _by_device(
    live: list[Tensor], buffers: list[Tensor]
) -> list[tuple[list[Tensor], list[Tensor]]]:
    groups: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
    for t, b in zip(live, buffers, strict=True):
        pair = groups.setdefault(t.device, ([], []))
        pair[0].append(t)
        pair[1].append(b)
    return list(groups.values())


#: Integer types of each element size: a select on their bits is exact for any dtype.
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


def _same(a: object, b: object) -> bool:
    """Whether a select can carry ``b`` (before) to ``a`` (after): same slot, same kind."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and a.layout == torch.strided
        )
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _same_structure(
    opt: torch.optim.Optimizer,
    state_before: dict[Tensor, dict[Any, Any]],
    groups_before: list[dict[str, Any]],
) -> bool:
    if set(opt.state.keys()) != set(state_before.keys()):
        return False
    for p, before in state_before.items():
        after = opt.state[p]
        if after.keys() != before.keys():
            return False
        if not all(_same(after[k], before[k]) for k in before):
            return False
    return all(
        g.keys() - {"params"} == before.keys() and all(_same(g[k], before[k]) for k in before)
        for g, before in zip(opt.param_groups, groups_before, strict=True)
    )


def _restore(
    opt: torch.optim.Optimizer,
    params: list[Tensor],
    param_copies: list[Tensor],
    state_before: dict[Tensor, dict[Any, Any]],
    state_copies: dict[Tensor, dict[Any, Tensor]],
    groups_before: list[dict[str, Any]],
) -> None:
    """Put back everything as it was before ``opt.step()`` (same tensor objects)."""
    for p, old in zip(params, param_copies, strict=True):
        p.detach().copy_(old)
    for p in list(opt.state.keys()):
        if p not in state_before:
            del opt.state[p]
    for p, before in state_before.items():
        for key, old in state_copies[p].items():
            before[key].detach().copy_(old)
        opt.state[p] = before
    for g, before in zip(opt.param_groups, groups_before, strict=True):
        for key in list(g.keys()):
            if key != "params" and key not in before:
                del g[key]
        g.update(before)
