r""":class:`StepGuard`: measure the gradients, then take, clip or exactly skip each step.

The guard is a loop helper over the public two-phase pieces::

    stat = gradlab.get_total_norm(grads)            # by="norm" (by="value": the inf-norm)
    keep = gradlab.keep_by_norm(stat, threshold)    # or a policy's threshold, a loss test
    gradlab.step_if_(optimizer, keep, sync=sync)    # the exact skip

and adds only what a loop needs on top: threshold policies, counters, a limit on skips
in a row, history and a callback, and the GradScaler and scheduler conveniences. Each
step it reads the host once with ``sync=True`` and not at all with ``sync=False`` (see
:class:`StepGuard` for the exceptions).
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from gradlab import distributed
from gradlab._common import (
    EPS,
    check_flag,
    check_int,
    check_keep,
    check_norm_type,
    check_process_group,
    check_threshold,
)
from gradlab.adaptive import ThresholdPolicy
from gradlab.clip import (
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
    keep_by_norm,
    keep_by_value,
)
from gradlab.flat import FlatGrads, flat_grads_of
from gradlab.step import mark_internal_hook, step_if_

__all__ = ["DECISIONS", "SkipLimitError", "StepGuard", "StepRecord"]

#: The decisions a :class:`StepGuard` records.
DECISIONS = ("kept", "clipped", "skipped")

_MODES = ("none", "clip", "skip")
_BY = ("norm", "value")
_GRAD_LAYOUTS = ("replicated", "sharded")
_LIMIT_ACTIONS = ("raise", "take")
_STATE_KEYS = frozenset({"num_steps", "counts", "consecutive_skips", "threshold", "loss_threshold"})


class SkipLimitError(RuntimeError):
    """Raised when a :class:`StepGuard` would skip more than ``max_consecutive_skips`` in a row."""


# ------------------------------------------------------------------------- records


class StepRecord:
    """What a :class:`StepGuard` saw and did at one call of :meth:`StepGuard.step`.

    Behaves like the tuple ``(step, total_norm, decision)``: it unpacks and compares
    like one.

    Attributes:
        step (int): the index of the call, 0 for the first (skipped calls included), so
            it equals the batch index of an ``enumerate`` loop.
        total_norm (float): the statistic the decision was based on: the total
            ``norm_type``-norm of the gradients (``by="norm"``) or their largest
            absolute entry (``by="value"``), before any clipping. May be nan or inf.
        decision (str): ``"kept"`` (stepped unchanged), ``"clipped"`` (clipped, then
            stepped) or ``"skipped"`` (no trace left).
        output: what ``optimizer.step()`` returned (``None`` if it was not called).

    ``total_norm`` and ``decision`` may be held as 0-dim device tensors until first
    read, so that recording a step never forces a host read; :attr:`pending` says
    whether they still are. Reading one reads every pending field of the record.
    """

    __slots__ = ("_clipped", "_keep", "_norm", "output", "step")

    def __init__(
        self,
        step: int,
        total_norm: float | Tensor,
        keep: bool | Tensor,
        clipped: bool | Tensor = False,
        output: Any = None,
    ) -> None:
        self.step = int(step)
        if isinstance(total_norm, Tensor):
            self._norm: float | Tensor = (
                total_norm.detach() if total_norm.requires_grad else total_norm
            )
        else:
            self._norm = float(total_norm)
        self._keep = keep
        self._clipped = clipped
        self.output = output

    @classmethod
    def of(cls, step: int, total_norm: float, decision: str) -> StepRecord:
        """A record with host values, ``decision`` one of :data:`DECISIONS`."""
        if decision not in DECISIONS:
            raise ValueError(f"decision must be one of {DECISIONS}, got {decision!r}")
        return cls(step, total_norm, decision != "skipped", decision == "clipped")

    @property
    def pending(self) -> bool:
        """True while a field is still a device tensor that has not been read."""
        return any(isinstance(v, Tensor) for v in (self._norm, self._keep, self._clipped))

    @property
    def total_norm(self) -> float:
        if self.pending:
            resolve([self])
        return self._norm  # type: ignore[return-value]

    @property
    def decision(self) -> str:
        if self.pending:
            resolve([self])
        if not self._keep:
            return "skipped"
        return "clipped" if self._clipped else "kept"

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


def resolve(records: list[StepRecord]) -> None:
    """Read every pending field of ``records`` with one transfer per device.

    .. note:: One host read per device that holds pending values.
    """
    slots: dict[torch.device, list[tuple[StepRecord, str, Tensor]]] = {}
    for record in records:
        for name in ("_norm", "_keep", "_clipped"):
            value = getattr(record, name)
            if isinstance(value, Tensor):
                slots.setdefault(value.device, []).append((record, name, value))
    for entries in slots.values():
        values = torch.stack([t.to(torch.float64) for _, _, t in entries]).tolist()
        for (record, name, _), value in zip(entries, values, strict=True):
            setattr(record, name, value if name == "_norm" else bool(value))


# --------------------------------------------------------------------------- guard


class StepGuard:
    r"""Take, clip or skip each optimizer step, depending on the gradients.

    .. code-block:: python

        guard = StepGuard(optimizer, mode="skip", threshold=1.0)
        for x, y in batches:
            loss_fn(model(x), y).backward()
            record = guard.step()          # StepRecord(step, total_norm, decision)
            optimizer.zero_grad()

    The statistic :math:`s` is the total norm :math:`\|g\|_p` of the optimizer's
    gradients (``by="norm"``) or their largest absolute entry (``by="value"``). A step is
    *within* a fixed threshold :math:`\tau` by the rules of
    :func:`gradlab.keep_by_norm` (torch's clip coefficient
    :math:`\tau / (s + 10^{-6})` is at least 1) and :func:`gradlab.keep_by_value`
    (:math:`s < \tau`). A :class:`~gradlab.adaptive.ThresholdPolicy` follows the scale
    of the norms, which may be far below :math:`10^{-6}`, so its threshold is compared
    without the epsilon: :math:`s \le \tau` by norm, clipped to exactly :math:`\tau`.
    NaN and inf are never within.

    ``mode``:

    * ``"skip"``: skip the step exactly (:func:`gradlab.step_if_`) unless within
      ``threshold``.
    * ``"clip"``: clip at ``threshold`` (as :func:`gradlab.clip_grads_with_norm_` /
      :func:`gradlab.clip_grad_value_`), then step; skip a non-finite step, and one
      over ``skip_above`` if given.
    * ``"none"``: record :math:`s` and always step. On an overflowing fp16 step this
      writes NaN into the weights: the baseline that shows the damage.

    ``loss_threshold`` (a number or a policy) also skips a step whose ``loss`` is above
    it, or not finite; ``scaler``'s ``found_inf`` skips one whose gradients overflowed.

    **Skips in a row.** ``max_consecutive_skips=N`` allows at most N skipped steps in a
    row; the step that would be the (N+1)-th triggers ``on_skip_limit``:

    * ``"take"``: take it, clipped to the threshold, if its statistic (and loss) is
      finite; a non-finite step is still skipped. Decided on the device: no host read.
      In ``"skip"`` mode with ``sync=False`` this costs one multiplication of the
      gradients per step (by 1 unless the limit is reached).
    * ``"raise"``: skip it and raise :class:`SkipLimitError`.
    * a callable: skip it and call ``on_skip_limit(guard)``, which may, say, raise the
      threshold.

    With ``sync=True`` the last two act at that step. With ``sync=False`` a device flag
    records that the limit was reached, and they act at the next check, made every N
    steps (one host read each): never missed, at most N - 1 steps late.

    **Host reads per step.** ``sync=True``: one (the decision), and ``step_if_``'s
    exceptions do not add any. ``sync=False``: none for fused optimizers, and those of
    :func:`gradlab.step_if_` otherwise (a step that creates optimizer state, step hooks,
    LBFGS), plus one every N steps for the limit checks above. The optimizer's own
    reads come on top, guard or not (Adam's CPU ``step`` tensors:
    ``gradlab.sync.HostReadCounter`` measures them). Memory: O(1), three 0-dim integers
    with ``sync=False``, and :func:`gradlab.step_if_`'s snapshot for optimizers that are
    not fused.

    **GradScaler.** Given ``scaler=``, ``guard.step()`` replaces
    ``scaler.step(optimizer)``::

        scaler.scale(loss).backward()
        guard.step()                 # unscales first if scaler.unscale_ was not called
        scaler.update()              # backs off on inf, as usual

    The guard measures the unscaled gradients, skips a step whose gradients overflowed,
    and marks the optimizer stepped for ``scaler.update()``. It refuses a second
    ``guard.step()`` before ``scaler.update()``, ``scaler.step(guard)``, and any
    ``optimizer.step()`` that does not come through the guard (a stray
    ``scaler.step(optimizer)``, enabled scaler or not). The scaler sees only overflow:
    a step the guard skips for a finite statistic advances the scaler's growth tracker,
    since its gradients were finite at that scale; only non-finite gradients back it
    off.

    **Gradient accumulation.** ``loss=`` is the loss the step's gradient belongs to:
    with k micro-batches, the sum of the k scaled micro-batch losses (the batch loss),
    not the last micro-batch's.

    **Many processes.** ``process_group`` with ``grads="replicated"`` (DDP: every rank
    holds the same averaged gradient) or ``grads="sharded"`` (each rank holds a part, as
    FSDP2 or tensors split by hand): the statistic is the global one, the loss is
    averaged over the group, and a rank that skips makes every rank skip, so replicas
    and policies stay bitwise identical. DTensor gradients (FSDP2, TP) are reduced over
    their own mesh; ``norm_parts`` says how plain gradients split over several groups (PP
    stages, expert groups) are reduced, as in :func:`gradlab.distributed.total_norm`::

        experts = {id(p) for p in model.experts.parameters()}
        guard = StepGuard(opt, "clip", threshold=1.0, process_group=world, norm_parts=lambda ps: [
            ([p.grad for p in ps if id(p) not in experts], pp_group),
            ([p.grad for p in ps if id(p) in experts], [ep_group, pp_group]),
        ])

    The norm is that of the optimizer's gradients
    in the order of its param groups; ``gradlab.clip_grad_norm_(model.parameters())``
    may sum them in another order and differ in the last bit.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer to guard.
        mode (str): ``"skip"``, ``"clip"`` or ``"none"``. Default: ``"skip"``
        by (str): ``"norm"`` or ``"value"``. Default: ``"norm"``
        threshold (float or ThresholdPolicy): :math:`\tau`, a non-negative number (inf
            allowed), or a policy. Default: 1.0
        norm_type (float or str): p of the total norm (``by="norm"``), a positive
            number or ``'inf'``. Default: 2.0
        sync (bool): ``True`` to read the decision on the host, ``False`` to keep it on
            the device. Default: True
        skip_above (float, optional): ``mode="clip"`` only: also skip a step whose
            statistic is over this number, which must not be below a fixed
            ``threshold``. Default: None
        loss_threshold (float or ThresholdPolicy, optional): skip a step whose loss is
            above it; then ``step(loss=...)`` is required. Default: None
        max_consecutive_skips (int, optional): the most steps skipped in a row, or
            ``None`` for no limit. Default: None
        on_skip_limit (str or Callable): ``"take"``, ``"raise"`` or a callable of the
            guard; see above. Default: ``"raise"``
        scaler (torch.amp.GradScaler, optional): the scaler of this optimizer's loss.
            Default: None
        scheduler (LRScheduler, optional): a scheduler of this optimizer, stepped after
            every taken step (``sync=True`` only: its ``step()`` is host code).
            Default: None
        history (int, optional): keep the last ``history`` records in :attr:`history`.
            Default: None
        on_record (Callable, optional): called with each :class:`StepRecord` (pending
            under ``sync=False``). Default: None
        process_group (ProcessGroup, optional): the ranks that decide together.
            Default: None
        grads (str, optional): ``"replicated"`` or ``"sharded"``, required with
            ``process_group`` unless ``norm_parts`` is given. Default: None
        norm_parts (Callable, optional): for gradients split over several groups (tensor,
            pipeline and expert parallelism): maps the parameters with a gradient to the
            ``parts`` of :func:`gradlab.distributed.total_norm`, a list of ``(gradients,
            groups)``, so that each gradient is reduced over its own groups and a
            replicated one is counted once. With ``process_group``, every rank of it
            decides alike. Default: None

    Raises:
        TypeError: ``optimizer`` is not a :class:`torch.optim.Optimizer`.
        ValueError: a bad argument, named, before anything changes.

    .. note::
        Under :func:`torch.compile` the decision (norm, threshold, flag) traces into one
        graph; ``optimizer.step()`` and, with ``sync=True``, the decision read break it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        mode: str = "skip",
        by: str = "norm",
        threshold: float | ThresholdPolicy = 1.0,
        norm_type: float | str = 2.0,
        *,
        sync: bool = True,
        skip_above: float | None = None,
        loss_threshold: float | ThresholdPolicy | None = None,
        max_consecutive_skips: int | None = None,
        on_skip_limit: str | Callable[[StepGuard], Any] = "raise",
        scaler: torch.amp.GradScaler | None = None,
        scheduler: Any = None,
        history: int | None = None,
        on_record: Callable[[StepRecord], Any] | None = None,
        process_group: Any = None,
        grads: str | None = None,
        norm_parts: Callable[[list[Tensor]], Any] | None = None,
    ) -> None:
        _check_optimizer(optimizer)
        _check_choice("mode", mode, _MODES)
        _check_choice("by", by, _BY)
        check_flag("sync", sync)
        policy, number = _threshold_arg("threshold", threshold)
        if skip_above is not None:
            if mode != "clip":
                raise ValueError(f'skip_above is for mode="clip" only, got mode={mode!r}')
            skip_above = _skip_above_arg(skip_above, number)
        if loss_threshold is not None:
            if mode == "none":
                raise ValueError('loss_threshold cannot skip anything with mode="none"')
            loss_policy, loss_number = _threshold_arg("loss_threshold", loss_threshold)
            if loss_policy is not None and loss_policy is policy:
                raise ValueError(
                    "threshold and loss_threshold are the same policy object; a policy "
                    "holds the state of one statistic: give each its own"
                )
        else:
            loss_policy, loss_number = None, None
        if max_consecutive_skips is not None:
            check_int("max_consecutive_skips", max_consecutive_skips, 1)
        if not (callable(on_skip_limit) or on_skip_limit in _LIMIT_ACTIONS):
            raise ValueError(
                f"on_skip_limit must be one of {_LIMIT_ACTIONS} or a callable, "
                f"got {on_skip_limit!r}"
            )
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        if scheduler is not None:
            _check_scheduler(scheduler, optimizer, sync)
        if history is not None:
            check_int("history", history, 1)
        if on_record is not None and not callable(on_record):
            raise ValueError(f"on_record must be callable, got {type(on_record).__name__}")
        if norm_parts is not None and not callable(norm_parts):
            raise ValueError(f"norm_parts must be callable, got {type(norm_parts).__name__}")
        _check_grad_layout(process_group, grads, norm_parts is not None)
        device = _first_device(optimizer)

        self._optimizer = optimizer
        self.mode, self.by, self.sync = mode, by, sync
        self.norm_type = check_norm_type(norm_type) if by == "norm" else math.inf
        self._policy, self._threshold = policy, number
        self._skip_above = skip_above
        self._loss_policy, self._loss_threshold = loss_policy, loss_number
        self._max_skips = max_consecutive_skips
        self._on_limit = on_skip_limit
        self._scaler, self._scheduler = scaler, scheduler
        self._history: deque[StepRecord] | None = None if history is None else deque(maxlen=history)
        self._on_record = on_record
        self._group = process_group
        self._norm_parts = norm_parts
        self._norm_group = _norm_group(optimizer, process_group, grads)
        self._steps = 0
        self._last: StepRecord | None = None
        self._recent: deque[Tensor | float] = deque(maxlen=5)  # named by SkipLimitError
        # Counters: host ints with sync=True; 0-dim int64 on the device with sync=False,
        # read only when asked. The run of skips is steps - 1 - last_taken.
        self._taken: int | Tensor = 0
        self._clipped: int | Tensor = 0
        self._last_taken: int | Tensor = -1
        self._limit_reached: bool | Tensor = False
        if not sync:
            zero = torch.zeros((), dtype=torch.int64, device=device)
            self._taken, self._clipped = zero, zero.clone()
            self._last_taken = torch.full((), -1, dtype=torch.int64, device=device)
            self._limit_reached = torch.zeros((), dtype=torch.bool, device=device)
        self._stepping = False
        if scaler is not None:
            optimizer.register_step_pre_hook(self._stray_step_check())

    # ------------------------------------------------------------------ properties

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        raise TypeError(
            "a StepGuard is not an optimizer: scaler.step(guard) would unscale and step "
            "around the guard. Give the guard scaler=scaler and call guard.step() in "
            "place of scaler.step(optimizer)."
        )

    @property
    def scheduler(self) -> Any:
        return self._scheduler

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler the guard drives (``None`` if it was given none)."""
        return self._scaler

    @property
    def threshold(self) -> float | ThresholdPolicy:
        """A number, or the policy, that each step's statistic is compared with (settable)."""
        return self._policy if self._policy is not None else self._threshold

    @threshold.setter
    def threshold(self, value: float | ThresholdPolicy) -> None:
        policy, number = _threshold_arg("threshold", value)
        if policy is not None and policy is self._loss_policy:
            raise ValueError("threshold: this policy is already the guard's loss_threshold")
        if self._skip_above is not None and policy is None and self._skip_above < number:
            raise ValueError(
                f"threshold={number!r} is above skip_above={self._skip_above!r}; lower "
                "skip_above first, or raise it"
            )
        self._policy, self._threshold = policy, number

    @property
    def skip_above(self) -> float | None:
        """``mode="clip"``: skip a step whose statistic is above this (settable)."""
        return self._skip_above

    @skip_above.setter
    def skip_above(self, value: float | None) -> None:
        if value is not None:
            if self.mode != "clip":
                raise ValueError(f'skip_above is for mode="clip" only, not {self.mode!r}')
            value = _skip_above_arg(value, self._threshold)
        self._skip_above = value

    @property
    def max_consecutive_skips(self) -> int | None:
        return self._max_skips

    @property
    def last(self) -> StepRecord | None:
        """The record of the latest step (``None`` before the first)."""
        return self._last

    @property
    def history(self) -> list[StepRecord]:
        """The last ``history`` records, oldest first.

        .. note:: Reads the pending records' values on the host (one read per device).
        """
        if self._history is None:
            raise RuntimeError("this guard keeps no history: build it with history=N")
        resolve([r for r in self._history if r.pending])
        return list(self._history)

    @property
    def taken(self) -> int:
        """Steps taken (kept or clipped). With ``sync=False``, one host read."""
        return self._read_counts()[0]

    @property
    def clipped(self) -> int:
        """Steps clipped, then taken. With ``sync=False``, one host read."""
        return self._read_counts()[1]

    @property
    def skipped(self) -> int:
        """Steps skipped. With ``sync=False``, one host read."""
        return self._steps - self._read_counts()[0]

    @property
    def consecutive_skips(self) -> int:
        """The current run of skipped steps. With ``sync=False``, one host read."""
        return self._steps - 1 - self._read_counts()[2]

    @property
    def num_steps(self) -> int:
        """How many :meth:`step` calls completed (skipped steps included)."""
        return self._steps

    def __repr__(self) -> str:
        return (
            f"StepGuard({type(self._optimizer).__name__}, mode={self.mode!r}, by={self.by!r}, "
            f"threshold={self.threshold!r}, sync={self.sync})"
        )

    # ------------------------------------------------------------------------ step

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        loss: Any = None,
        keep: Tensor | bool | None = None,
    ) -> StepRecord:
        """Measure the gradients, then take, clip or skip the optimizer step.

        Args:
            closure (Callable, optional): for optimizers that need one (LBFGS): the
                guard calls it once to compute the gradients it measures; every further
                evaluation by the optimizer is clipped again in ``"clip"`` mode.
                Default: None
            loss (Tensor or float, optional): the batch's loss, a number or a 0-dim
                tensor, compared with ``loss_threshold`` (the closure's return value
                when not given). Default: None
            keep (Tensor or bool, optional): a further condition on the device, a 0-dim
                bool tensor: the step is skipped where it is false, as by the guard's
                own rule (``kept > 0`` from
                :meth:`gradlab.accumulation.MicroBatchAccumulator.finish_`, a check of
                your own). Default: None

        Returns:
            StepRecord: the record of this step.

        Raises:
            ValueError: a loss that is not 0-dim, or missing for ``loss_threshold``;
                sparse gradients. Checked before anything changes.
            RuntimeError: no gradient; scaler misuse; a step outside the guard.
            SkipLimitError: more than ``max_consecutive_skips`` skips in a row.

        .. note::
            ``sync=True`` reads the decision on the host once. ``sync=False`` reads
            nothing except as listed in the class notes.
        """
        if closure is not None:
            if not callable(closure):
                raise ValueError(f"closure must be callable, got {type(closure).__name__}")
            if self._scaler is not None and self._scaler.is_enabled():
                raise ValueError("closure cannot be used with an enabled GradScaler")
        loss_t = self._check_loss(loss, required=closure is None)
        if keep is not None:
            keep = check_keep(keep)
        closure_loss = None
        if closure is not None:
            with torch.enable_grad():
                closure_loss = closure()
            if loss_t is None and self._needs_loss:
                loss_t = self._check_loss(closure_loss, required=True)
        params = self._params_with_grad()
        found_inf = self._scaler_found_inf(params)
        with torch.no_grad():
            stat, taken, clipped, loss_t = self._decide(params, loss_t, found_inf, keep)
            if self.sync:
                taken, clipped = _read_decision(taken, clipped)
            output = self._step(taken, closure, closure_loss, params, stat)
            self._update_policies(stat, taken, loss_t)
            self._count(taken, clipped)
        record = StepRecord(self._steps, stat, taken, clipped, output)
        self._steps += 1
        self._last = record
        self._recent.append(stat)
        if self._history is not None:
            self._history.append(record)
        if self._on_record is not None:
            self._on_record(record)
        self._check_skip_limit()
        return record

    @property
    def _needs_loss(self) -> bool:
        return self._loss_threshold is not None or self._loss_policy is not None

    def _check_loss(self, loss: Any, required: bool) -> Tensor | None:
        if loss is None:
            if self._needs_loss and required:
                raise ValueError("this guard has a loss_threshold: call guard.step(loss=loss)")
            return None
        if isinstance(loss, Tensor):
            if loss.dim() != 0 or not (loss.dtype.is_floating_point or loss.dtype == torch.int64):
                raise ValueError(
                    "loss must be a number or a 0-dim real tensor (the batch's loss, e.g. "
                    f"losses.mean()), got shape {tuple(loss.shape)} and dtype {loss.dtype}"
                )
            return loss.detach() if self._needs_loss else None
        if isinstance(loss, bool) or not isinstance(loss, numbers.Real):
            raise ValueError(f"loss must be a number or a 0-dim tensor, got {type(loss).__name__}")
        return torch.tensor(float(loss), dtype=torch.float64) if self._needs_loss else None

    def _params_with_grad(self) -> list[Tensor] | FlatGrads:
        flat = flat_grads_of(self._optimizer) if self._norm_parts is None else None
        if flat is not None:
            return flat  # every parameter has a gradient, a dense view: no walk needed
        params = [
            p for g in self._optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        if not params:
            raise RuntimeError(
                "StepGuard.step() found no gradient: no parameter of the optimizer has a "
                ".grad. Call loss.backward() before guard.step()."
            )
        if any(p.grad.layout != torch.strided for p in params):
            raise ValueError("StepGuard does not support sparse gradients: use dense ones")
        return params

    def _decide(
        self,
        params: list[Tensor] | FlatGrads,
        loss: Tensor | None,
        found_inf: Tensor | None,
        condition: Tensor | bool | None = None,
    ) -> tuple[Tensor, Tensor | bool, Tensor | bool, Tensor | None]:
        """(statistic, keep, clipped, loss) on the device; clips in ``"clip"`` mode. No read."""
        stat = self._statistic(params)
        if self.mode == "none":
            return stat, True if condition is None else condition, False, loss
        tau = self._threshold if self._policy is None else self._policy.threshold(stat)
        within = self._within(stat, tau, self._policy is not None)
        keep: Tensor | bool
        clipped: Tensor | bool
        if self.mode == "skip":
            keep, clipped = within, False
        else:
            self._clip(params, stat, tau)
            keep, clipped = torch.isfinite(stat), torch.logical_not(within)
            if self._skip_above is not None:
                keep = keep & self._within(stat, self._skip_above, False)
        if loss is not None:
            if self._group is not None:
                loss = distributed.all_reduce_mean(loss, self._group)
            policy = self._loss_policy
            limit = policy.threshold(loss) if policy is not None else self._loss_threshold
            assert limit is not None  # _needs_loss: a number or a policy
            keep = keep & (loss.double() <= _as_float64(limit))
        if found_inf is not None:
            keep = keep & (found_inf == 0)
        if condition is not None:
            keep = keep & condition
        if self._max_skips is not None and self._on_limit == "take":
            forced = self._forced_at_limit(keep, stat, loss, found_inf, condition)
            if forced is not None:
                if self.mode == "skip":  # clip mode has clipped already
                    self._clip(params, stat, torch.where(forced, _as_float64(tau), math.inf))
                    clipped = forced
                keep = keep | forced
        if self._group is not None:
            keep = distributed.all_reduce_keep(keep, self._group)
        return stat, keep, clipped, loss

    def _statistic(self, params: list[Tensor] | FlatGrads) -> Tensor:
        if isinstance(params, FlatGrads):
            return get_total_norm(params, self.norm_type, process_group=self._norm_group)
        if self._norm_parts is not None:
            return distributed.total_norm(self._norm_parts(params), self.norm_type)
        grads = [cast(Tensor, p.grad) for p in params]  # _params_with_grad checked them
        return get_total_norm(grads, self.norm_type, process_group=self._norm_group)

    def _within(self, stat: Tensor, tau: float | Tensor, relative: bool) -> Tensor:
        if self.by == "value":
            return keep_by_value(stat, tau)
        return keep_by_norm(stat, tau, eps=0.0 if relative else EPS)

    def _clip(self, params: list[Tensor] | FlatGrads, stat: Tensor, tau: float | Tensor) -> None:
        if self.by == "value":
            clip_grad_value_(params, tau)
        else:
            clip_grads_with_norm_(params, tau, stat, eps=0.0 if self._policy is not None else EPS)

    def _forced_at_limit(
        self,
        keep: Tensor | bool,
        stat: Tensor,
        loss: Tensor | None,
        found_inf: Tensor | None,
        condition: Tensor | bool | None,
    ) -> Tensor | None:
        """Whether this step is over the limit and finite, so taken anyway (None: not).

        Never a step with a non-finite statistic or loss, an overflow, or the caller's
        ``keep`` false.

        With ``sync=True`` the run is known on the host, and None says the run has not
        reached the limit. The run before this step is ``steps - 1 - last_taken``.
        """
        if self.sync and self._steps - 1 - self._last_taken < self._max_skips:  # type: ignore[operator]
            return None
        finite = torch.isfinite(stat)
        if loss is not None:
            finite = finite & torch.isfinite(loss)
        if found_inf is not None:
            finite = finite & (found_inf == 0)
        if condition is not None:
            finite = finite & condition
        forced = finite & ~_as_bool_tensor(keep, stat.device)
        if not self.sync:
            assert isinstance(self._last_taken, Tensor) and self._max_skips is not None
            forced = forced & torch.lt(self._last_taken, self._steps - self._max_skips)
        return forced

    def _step(
        self,
        keep: Tensor | bool,
        closure: Callable[[], Any] | None,
        closure_loss: Any,
        params: list[Tensor] | FlatGrads,
        stat: Tensor,
    ) -> Any:
        opt_closure = None if closure is None else self._closure_for_step(closure, closure_loss)
        self._stepping = True
        try:
            output = step_if_(self._optimizer, keep, opt_closure, sync=self.sync)
        finally:
            self._stepping = False
        if self._scheduler is not None and keep:
            self._scheduler.step()
        if self._scaler is not None and self._scaler.is_enabled():
            self._scaler._per_optimizer_states[id(self._optimizer)]["stage"] = OptState.STEPPED
        return output

    def _closure_for_step(self, closure: Callable[[], Any], first_loss: Any) -> Callable[[], Any]:
        """The closure the optimizer calls: the guard's own evaluation first, then fresh
        ones, clipped as the first was (an optimizer such as LBFGS evaluates often)."""
        evaluations = 0

        def evaluate() -> Any:
            nonlocal evaluations
            evaluations += 1
            if evaluations == 1:
                return first_loss  # the gradients the guard measured, clipped if asked
            with torch.enable_grad():
                value = closure()
            if self.mode == "clip":
                params = self._params_with_grad()
                with torch.no_grad():
                    stat = self._statistic(params)
                    tau = self._threshold if self._policy is None else self._policy.threshold(stat)
                    self._clip(params, stat, tau)
            return value

        return evaluate

    def _update_policies(self, stat: Tensor, keep: Tensor | bool, loss: Tensor | None) -> None:
        if self._policy is None and self._loss_policy is None:
            return
        taken = _as_bool_tensor(keep, stat.device)
        if self._policy is not None:
            self._policy.update(stat, taken)
        if self._loss_policy is not None and loss is not None:
            self._loss_policy.update(loss, taken.to(loss.device))

    def _count(self, keep: Tensor | bool, clipped: Tensor | bool) -> None:
        if self.sync:
            if keep:
                self._taken += 1
                self._clipped += bool(clipped)
                self._last_taken = self._steps
            return
        taken, last = self._taken, self._last_taken
        assert isinstance(taken, Tensor) and isinstance(last, Tensor)
        keep_t = _as_bool_tensor(keep, taken.device)
        if self._max_skips is not None and self._on_limit != "take":
            over = torch.logical_not(keep_t) & torch.lt(last, self._steps - self._max_skips)
            self._limit_reached.logical_or_(over)  # type: ignore[union-attr]
        # In place, on tensors made once: a new tensor per step costs more than the kernel.
        taken.add_(keep_t)
        last.masked_fill_(keep_t, self._steps)
        if isinstance(clipped, Tensor):
            self._clipped.add_(keep_t & clipped)  # type: ignore[union-attr]

    def _read_counts(self) -> tuple[int, int, int]:
        """(taken, clipped, last taken step): one host read with ``sync=False``."""
        if self.sync:
            return int(self._taken), int(self._clipped), int(self._last_taken)
        counts = torch.stack([self._taken, self._clipped, self._last_taken])  # type: ignore[list-item]
        taken, clipped, last = counts.tolist()
        return taken, clipped, last

    def _check_skip_limit(self) -> None:
        limit = self._max_skips
        if limit is None or self._on_limit == "take":
            return
        if self.sync:
            if self._steps - 1 - self._last_taken <= limit:
                return
            run = self._steps - 1 - self._last_taken
            where = f"at step {self._steps - 1}"
        else:
            if self._steps % limit:
                return  # checked every `limit` steps: one host read
            reached = self._limit_reached
            assert isinstance(reached, Tensor)
            if not bool(reached):
                return
            reached.zero_()
            run = limit + 1
            where = f"in steps {max(0, self._steps - 2 * limit)} to {self._steps - 1}"
        if callable(self._on_limit):
            self._on_limit(self)
            return
        recent = ", ".join(f"{float(v):.4g}" for v in self._recent)
        raise SkipLimitError(
            f"StepGuard skipped {run} steps in a row {where} (max_consecutive_skips="
            f"{limit}); threshold={self.threshold!r}"
            + (f", skip_above={self._skip_above!r}" if self._skip_above is not None else "")
            + f"; the last statistics were [{recent}]. Pass on_skip_limit='take' to take "
            "such a step clipped, a callable to adjust the threshold, or lower the "
            "learning rate."
        )

    # ---------------------------------------------------------------------- scaler

    def _stray_step_check(self) -> Callable[..., None]:
        """A step pre-hook that refuses any ``optimizer.step()`` not made by this guard."""

        def refuse_stray_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if not self._stepping:
                raise RuntimeError(
                    "this optimizer is guarded by a StepGuard with a scaler: step it with "
                    "guard.step() (which replaces scaler.step(optimizer)), not "
                    "optimizer.step() or scaler.step(optimizer)"
                )

        return mark_internal_hook(refuse_stray_step)

    def _scaler_found_inf(self, params: list[Tensor] | FlatGrads) -> Tensor | None:
        """The scaler's found_inf for this step, unscaling first if it was not done."""
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled():
            return None
        state = scaler._per_optimizer_states[id(self._optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "StepGuard.step(): this optimizer was already stepped since the last "
                "scaler.update(). Call scaler.update() once after each guard.step()."
            )
        if state["stage"] is OptState.READY:
            scaler.unscale_(self._optimizer)  # the guard must measure unscaled gradients
        device = params.buffers[0].device if isinstance(params, FlatGrads) else params[0].device
        found = [f.to(device) for f in state["found_inf_per_device"].values()]
        return torch.stack(found).sum() if found else None

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The guard's own state: counters and threshold policies.

        Like :class:`torch.amp.GradScaler`, it holds neither the optimizer's nor the
        scheduler's state: save those as usual.

        .. note:: With ``sync=False`` this reads the device counters on the host.
        """
        taken, clipped, last = self._read_counts()
        return {
            "num_steps": self._steps,
            "counts": [taken - clipped, clipped, self._steps - taken],
            "consecutive_skips": self._steps - 1 - last,
            "threshold": None if self._policy is None else self._policy.state_dict(),
            "loss_threshold": None if self._loss_policy is None else self._loss_policy.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; checked whole before anything changes.

        Raises:
            ValueError: ``state_dict`` is not a StepGuard state dict, or its policies do
                not match this guard's.
        """
        if not isinstance(state_dict, dict) or state_dict.keys() != _STATE_KEYS:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"not a StepGuard state dict: expected the keys {sorted(_STATE_KEYS)}, got "
                f"{got}. (StepGuard.state_dict() holds only the guard's own state; load the "
                "optimizer's with optimizer.load_state_dict.)"
            )
        steps = check_int("num_steps", state_dict["num_steps"], 0)
        counts = [check_int("counts", n, 0) for n in state_dict["counts"]]
        run = check_int("consecutive_skips", state_dict["consecutive_skips"], 0)
        if len(counts) != len(DECISIONS) or sum(counts) != steps or run > counts[2]:
            raise ValueError(
                f"state_dict: counts {counts} must be {len(DECISIONS)} numbers (kept, "
                f"clipped, skipped) that add up to num_steps={steps}, with "
                f"consecutive_skips={run} at most the skipped ones"
            )
        for name, policy in (("threshold", self._policy), ("loss_threshold", self._loss_policy)):
            if (state_dict[name] is None) != (policy is None):
                raise ValueError(
                    f"{name}: the state dict was saved with"
                    f"{'out' if state_dict[name] is None else ''} a policy, this guard has "
                    f"{'none' if policy is None else 'one'}"
                )
        for name, policy in (("threshold", self._policy), ("loss_threshold", self._loss_policy)):
            if policy is not None:
                policy.load_state_dict(state_dict[name])
        taken, clipped, last = counts[0] + counts[1], counts[1], steps - 1 - run
        if self.sync:
            self._taken, self._clipped, self._last_taken = taken, clipped, last
        else:
            for tensor, value in ((self._taken, taken), (self._clipped, clipped)):
                tensor.fill_(value)  # type: ignore[union-attr]
            self._last_taken.fill_(last)  # type: ignore[union-attr]
        self._steps = steps


# ------------------------------------------------------------------------- helpers


def _read_decision(keep: Tensor | bool, clipped: Tensor | bool) -> tuple[bool, bool]:
    """(keep, clipped) read on the host: one transfer."""
    if not isinstance(keep, Tensor) and not isinstance(clipped, Tensor):
        return keep, clipped
    if not isinstance(clipped, Tensor):
        return bool(keep), clipped
    pair = torch.stack([torch.as_tensor(keep, device=clipped.device), clipped]).tolist()
    return bool(pair[0]), bool(pair[1])


def _as_bool_tensor(value: Tensor | bool, device: torch.device) -> Tensor:
    """``value`` as a 0-dim bool tensor; a Python bool is filled on the device (no copy)."""
    if isinstance(value, Tensor):
        return value
    return torch.full((), value, dtype=torch.bool, device=device)


def _as_float64(threshold: float | Tensor) -> float | Tensor:
    return threshold.double() if isinstance(threshold, Tensor) else threshold


def _check_optimizer(optimizer: object) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError(
            "StepGuard does not support SparseAdam: its sparse gradients have no total "
            "norm to guard; use a dense optimizer"
        )


def _first_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    raise ValueError("optimizer has no parameters in any param group")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        hint = ' ("ignore" was renamed "skip" in gradlab 0.2)' if value == "ignore" else ""
        raise ValueError(f"{name} must be one of {choices}, got {value!r}{hint}")


def _threshold_arg(name: str, value: object) -> tuple[ThresholdPolicy | None, float]:
    """``(policy, nan)`` for a policy, ``(None, number)`` for a valid number."""
    if not isinstance(value, numbers.Number) and isinstance(value, ThresholdPolicy):
        return value, math.nan
    return None, check_threshold(name, value)


def _skip_above_arg(value: object, threshold: float) -> float:
    number = check_threshold("skip_above", value)
    if not math.isnan(threshold) and number < threshold:
        raise ValueError(
            f"skip_above={number!r} is below threshold={threshold!r}: every step it "
            "skips would be clipped first; give a skip_above at least the threshold"
        )
    return number


def _check_grad_layout(process_group: Any, grads: str | None, has_parts: bool) -> None:
    check_process_group(process_group)
    if has_parts:
        if grads is not None:
            raise ValueError(
                "norm_parts says how every gradient is split across ranks; "
                f"grads={grads!r} is for a guard without it"
            )
        return
    if process_group is None:
        if grads is not None:
            raise ValueError(f"grads={grads!r} is for a guard with a process_group; got none")
        return
    if grads not in _GRAD_LAYOUTS:
        raise ValueError(
            'with process_group, say how the gradients are laid out: grads="replicated" '
            '(DDP: every rank holds the same averaged gradient) or grads="sharded" (each '
            f"rank holds a part, as FSDP2 or tensors split by hand); got grads={grads!r}"
        )


def _norm_group(optimizer: torch.optim.Optimizer, process_group: Any, grads: str | None) -> Any:
    """The group the norm is summed over, beyond what DTensors' own meshes reduce."""
    if grads != "sharded":
        return None
    params = [p for g in optimizer.param_groups for p in g["params"]]
    dtensors = [distributed.is_dtensor(p) for p in params]
    if all(dtensors):
        return distributed.group_beyond_meshes(params, process_group)
    if any(dtensors):
        raise ValueError(
            'grads="sharded" with DTensor and plain parameters together: pass norm_parts= '
            "to say which are split over which group (gradlab.distributed.total_norm)"
        )
    return process_group


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
            "scheduler must be a torch.optim.lr_scheduler scheduler of the guarded "
            "optimizer (its .optimizer is another optimizer, or missing)"
        )
