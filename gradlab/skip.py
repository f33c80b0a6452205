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
tensor bit for bit as if the batch had never been seen, fires no optimizer step hook
and does not advance the learning-rate scheduler either.

Three ways to skip exactly:

``sync=True``
    Read the decision on the host (one read per step, as :class:`torch.amp.GradScaler`
    does with ``found_inf``) and simply do not call ``optimizer.step()``.

``sync=False``, fused optimizer
    Adam, AdamW, SGD and Adagrad with ``fused=True`` skip inside their kernel when
    their ``found_inf`` flag is set (the protocol :class:`torch.amp.GradScaler` uses):
    the guard writes its decision into a persistent 0-dim flag, in place. No copy.

``sync=False``, any other optimizer
    Copy what the step can change, step, then keep the new or the old value of every
    tensor with a device-side select (:mod:`gradlab._transaction`).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState
from torch.optim import optimizer as _optim_module

from gradlab import _distributed
from gradlab._transaction import Transaction
from gradlab.adaptive import ThresholdPolicy
from gradlab.clip import (
    _SAME_WIDTH_INT,
    _check_norm_type,
    _check_process_group,
    _check_threshold,
    _clamp_,
    _clip_,
    _groups,
    _keep_by_norm,
    _keep_by_value,
    get_total_norm,
)

__all__ = ["DECISIONS", "SkipLimitError", "StepGuard", "StepRecord", "ThresholdPolicy"]

#: The decisions a :class:`StepGuard` records, indexed by their device-side code.
DECISIONS = ("kept", "clipped", "skipped")
_KEPT, _CLIPPED, _SKIPPED = 0, 1, 2
_SKIPS, _RUN, _CLIPS = 0, 1, 2  # the guard's tally of its steps


def _decision_name(decision: Tensor, value: float) -> str:
    """The name of a device decision read as ``value``: a keep boolean or a code."""
    if decision.dtype == torch.bool:
        return "kept" if value else "skipped"
    return DECISIONS[int(value)]


_MODES = ("none", "clip", "skip")
_BY = ("norm", "value")
_GRAD_LAYOUTS = ("replicated", "sharded")
_STATE_KEYS = frozenset({"num_steps", "counts", "consecutive_skips", "threshold", "loss_threshold"})


class SkipLimitError(RuntimeError):
    """Raised when a :class:`StepGuard` skips more than ``max_consecutive_skips`` steps in a row."""


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
        output: what ``optimizer.step()`` returned (``None`` if it was not called).

    ``total_norm`` and ``decision`` may be held as 0-dim device tensors until they
    are first read (a host read), so that recording a step never forces one: the
    decision as a boolean (True: kept, False: skipped) or as an integer code, its
    index in :data:`DECISIONS`.
    """

    __slots__ = ("_decision", "_norm", "output", "step")

    def __init__(
        self, step: int, total_norm: float | Tensor, decision: str | Tensor, output: Any = None
    ) -> None:
        if isinstance(decision, str) and decision not in DECISIONS:
            raise ValueError(f"decision must be one of {DECISIONS}, got {decision!r}")
        self.step = int(step)
        if not isinstance(total_norm, Tensor):
            total_norm = float(total_norm)
        elif total_norm.requires_grad:
            total_norm = total_norm.detach()
        self._norm: float | Tensor = total_norm
        self._decision: str | Tensor = decision
        self.output = output

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
        for (record, name, tensor), value in zip(entries, values, strict=True):
            if name == "_norm":
                record._norm = value
            else:
                record._decision = _decision_name(tensor, value)


# --------------------------------------------------------------------------- guard


class StepGuard:
    r"""Take, clip or skip each optimizer step, depending on the gradients.

    .. code-block:: python

        guard = StepGuard(optimizer, mode="skip", threshold=1.0)
        for x, y in batches:
            loss_fn(model(x), y).backward()
            record = guard.step()          # StepRecord(step, total_norm, decision)
            guard.zero_grad()

    The statistic :math:`s` is the total norm :math:`\|g\|_p` of the optimizer's
    gradients (``by="norm"``) or their largest absolute entry (``by="value"``). A step
    is *over* a threshold :math:`\tau` by the rules of :func:`gradlab.grad_ignore_norm_`
    and :func:`gradlab.grad_ignore_value_`: :math:`\tau / (s + 10^{-6}) < 1` by norm,
    rounded as torch rounds its clip coefficient, :math:`s \ge \tau` by value; NaN is
    always over. A fixed :math:`\tau` is turned once into the largest :math:`s` it
    keeps, so that each step makes one comparison.

    ``mode``:

    * ``"skip"``: skip the step exactly when over ``threshold`` or non-finite.
      (``"ignore"`` is a deprecated alias: :func:`gradlab.grad_ignore_norm_` *zeroes*.)
    * ``"clip"``: clip at ``threshold`` (as :func:`gradlab.clip_grad_norm_` /
      :func:`gradlab.clip_grad_value_`), then step; skip a non-finite step, and one
      over ``skip_above`` if given.
    * ``"none"``: record :math:`s` and always step. On an overflowing fp16 step this
      writes NaN into the weights: the baseline that shows the damage.

    A skipped step leaves the parameters, every optimizer-state tensor (nested ones and
    Adam's ``step`` included), the param groups and the scheduler as if the batch had
    never been seen, and fires no step hook. The gradients are not restored.

    Host reads per step (:class:`gradlab.sync.HostReadCounter`, torch 2.13), for k
    parameters with a gradient: the guard's, plus the optimizer's own, which it makes
    guard or not (reads of its CPU ``step`` tensors, not GPU syncs):

    ==================================================  ==========  ===========  ======
    optimizer (torch.optim)                             sync=True   sync=False   own
    ==================================================  ==========  ===========  ======
    ``fused=True`` Adam, AdamW, SGD, Adagrad            1           0            0
    SGD, Adadelta, RMSprop, Muon, capturable Adam(W)    1           0            0
    Adam, AdamW, Adamax, RAdam, Adagrad                 1 + k       k            k
    Adam, AdamW with ``foreach=True``                   1 + 2k      2k           2k
    NAdam, ASGD, Adafactor                              1 + 3k      3k           3k
    Rprop                                               1 + 4k      4k           4k
    LBFGS (``step(closure)``)                           1 + own     1 + own      many
    ==================================================  ==========  ===========  ======

    ``sync=False`` adds one read in a step that creates optimizer state (the first, and
    each one after a skipped first; not Adagrad, whose state exists from the start), in
    every step where the state changes structure (a Python number, a list that grows:
    LBFGS) or step hooks are registered (hooks are host code), and one every
    ``max_consecutive_skips`` steps to check that limit. ``sync=True`` steps the
    scheduler with no further read. Memory: one copy of the stepped parameters and
    their state on the snapshot path (allocated once), and on every path O(1): five
    numbers on the device (three counters, the flag and a 1 beside it) and each fixed
    threshold as four 0-dim CPU tensors.

    With :class:`torch.amp.GradScaler`, measure the unscaled gradients::

        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)   # done by the guard if it was given scaler=
        guard.step()                 # skips if the guard or the scaler says so
        scaler.update()              # backs off on inf, as usual

    Given ``scaler=``, the guard unscales if needed, marks the optimizer stepped (so a
    stray ``scaler.step(optimizer)`` raises) and refuses a second ``guard.step()`` before
    ``scaler.update()``. ``scaler.step(guard)`` also works, with the scaler's own read.

    Args:
        optimizer: the :class:`torch.optim.Optimizer` to guard.
        mode: ``"skip"``, ``"clip"`` or ``"none"``.
        by: ``"norm"`` or ``"value"``.
        threshold: :math:`\tau`: a non-negative number (``inf`` allowed) or a
            :class:`ThresholdPolicy`.
        norm_type: p of the total norm, a positive number or ``inf`` (``by="norm"``).
        scheduler: a learning-rate scheduler of this optimizer, stepped after every
            taken step (``sync=True`` only: its ``step()`` is host code).
        sync: ``True`` to decide on the host, ``False`` to keep the decision on the device.
        skip_above: ``mode="clip"`` only: also skip when over this larger number.
        loss_threshold: a number or policy; ``step(loss=...)`` skips a loss over it.
        scaler: the :class:`torch.amp.GradScaler` that scales this optimizer's loss.
        max_consecutive_skips: raise :class:`SkipLimitError` after this many skips in a
            row (``None``: never).
        history: keep the last ``history`` records in :attr:`history` (default none).
        on_record: called with each :class:`StepRecord` (pending under ``sync=False``).
        process_group: the ranks that decide together (``None``: this process alone).
        grads: ``"replicated"`` or ``"sharded"``, required with ``process_group``.

    Raises:
        TypeError: ``optimizer`` is not a :class:`torch.optim.Optimizer`.
        ValueError: a bad argument, named; a sparse optimizer (SparseAdam).

    .. note::
        Under :func:`torch.compile` the decision (norm, thresholds, flag) traces into one
        graph; ``optimizer.step()`` and, with ``sync=True``, the decision read break it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        mode: str = "skip",
        by: str = "norm",
        threshold: float | ThresholdPolicy = 1.0,
        norm_type: float | str = 2.0,
        scheduler: Any = None,
        sync: bool = True,
        *,
        skip_above: float | None = None,
        loss_threshold: float | ThresholdPolicy | None = None,
        scaler: torch.amp.GradScaler | None = None,
        max_consecutive_skips: int | None = 100,
        history: int | None = None,
        on_record: Callable[[StepRecord], None] | None = None,
        process_group: Any = None,
        grads: str | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise ValueError(
                "StepGuard does not support SparseAdam: its sparse gradients have no total "
                "norm to guard and its state cannot be snapshotted; use a dense optimizer"
            )
        if mode == "ignore":
            warnings.warn(
                'StepGuard(mode="ignore") is deprecated, use mode="skip": the step is '
                "skipped, whereas gradlab.grad_ignore_norm_ zeroes the gradients",
                FutureWarning,
                stacklevel=2,
            )
            mode = "skip"
        if not isinstance(mode, str) or mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if not isinstance(by, str) or by not in _BY:
            raise ValueError(f"by must be one of {_BY}, got {by!r}")
        if not isinstance(sync, bool):
            raise ValueError(f"sync must be True or False, got {sync!r}")
        if skip_above is not None and mode != "clip":
            raise ValueError(f'skip_above is for mode="clip" only, got mode={mode!r}')
        if loss_threshold is not None and mode == "none":
            raise ValueError('loss_threshold cannot skip anything with mode="none"')
        if max_consecutive_skips is not None and (
            isinstance(max_consecutive_skips, bool)
            or not isinstance(max_consecutive_skips, int)
            or max_consecutive_skips < 1
        ):
            raise ValueError(
                "max_consecutive_skips must be a positive int or None, got "
                f"{max_consecutive_skips!r}"
            )
        if history is not None and (
            isinstance(history, bool) or not isinstance(history, int) or history < 1
        ):
            raise ValueError(f"history must be a positive int or None, got {history!r}")
        if on_record is not None and not callable(on_record):
            raise ValueError(f"on_record must be callable, got {type(on_record).__name__}")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        _check_grad_layout(process_group, grads)
        self._optimizer = optimizer
        self.mode = mode
        self.by = by
        self.norm_type = _check_norm_type(norm_type)
        self.sync = sync
        # Fixed thresholds are 0-dim tensors so that a compiled decision does not
        # specialise (and recompile) on their value.
        device = optimizer.param_groups[0]["params"][0].device
        rule = _keep_by_norm if by == "norm" else _keep_by_value
        self._policy, number = _threshold_arg("threshold", threshold)
        # a policy's guard holds an unused fixed threshold: inf, inverted once
        self._threshold = _Fixed(math.inf if self._policy is not None else number, rule, device)
        self._loss_policy, self._loss_threshold = None, None
        if loss_threshold is not None:
            self._loss_policy, number = _threshold_arg("loss_threshold", loss_threshold)
            self._loss_threshold = _Fixed(number, device=device)
        self._skip_above = None
        if skip_above is not None:
            number = _threshold_arg("skip_above", skip_above, policy=False)[1]
            self._skip_above = _Fixed(number, rule, device)
        if scheduler is not None:
            _check_scheduler(scheduler, optimizer, sync)
        self._scheduler = scheduler
        self._scaler = scaler
        self.max_consecutive_skips = max_consecutive_skips
        self._history: deque[StepRecord] | None = None if history is None else deque(maxlen=history)
        self._on_record = on_record
        self._group = process_group
        self._norm_group = process_group if grads == "sharded" else None
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._transaction = None if self._fused else Transaction(optimizer)
        self._device_codes = {device: _Codes(device)}
        self._steps = 0
        # Skipped steps, the current run of skips and clipped steps (kept ones are the
        # rest): Python ints with sync=True, float64 on the device with sync=False, read
        # only when asked.
        self._tally: list[int] | Tensor = [0, 0, 0]
        if not sync:
            self._tally = torch.zeros(3, dtype=torch.float64, device=device)
            self._skip_tally, self._clip_tally = self._tally[:_CLIPS], self._tally[_CLIPS]
            # [1, flag]: the flag is a view, the found_inf of a fused optimizer
            self._skip_pair = torch.tensor([1.0, 0.0], device=device)
            self._flag = self._skip_pair[1]
            if self._fused:
                optimizer.found_inf = self._flag
        self._last: StepRecord | None = None
        self._recent: deque[Tensor] = deque(maxlen=5)  # statistics named by SkipLimitError

    # ------------------------------------------------------------------ properties

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups (so that ``scaler.step(guard)`` works)."""
        return self._optimizer.param_groups

    @property
    def scheduler(self) -> Any:
        return self._scheduler

    @property
    def threshold(self) -> float | ThresholdPolicy:
        """The threshold: a float (settable without recompiling) or the policy."""
        return self._policy if self._policy is not None else self._threshold.value

    @threshold.setter
    def threshold(self, value: float | ThresholdPolicy) -> None:
        self._policy, number = _threshold_arg("threshold", value)
        if self._policy is None:
            self._threshold.fill_(number)

    @property
    def last(self) -> StepRecord | None:
        """The record of the latest step (``None`` before the first)."""
        return self._last

    @property
    def history(self) -> list[StepRecord]:
        """The last ``history`` records, oldest first (pending values are read now).

        .. note:: With ``sync=False`` this reads the pending records' values on the host.
        """
        if self._history is None:
            raise RuntimeError("this guard keeps no history: build it with history=N")
        _resolve([r for r in self._history if r.pending])
        return list(self._history)

    @property
    def taken(self) -> int:
        """Steps taken (kept or clipped).

        .. note:: With ``sync=False`` the counters live on the device: one host read.
        """
        counts, _ = self._read_counts()
        return counts[_KEPT] + counts[_CLIPPED]

    @property
    def clipped(self) -> int:
        """Steps clipped, then taken.

        .. note:: With ``sync=False`` the counters live on the device: one host read.
        """
        return self._read_counts()[0][_CLIPPED]

    @property
    def skipped(self) -> int:
        """Steps skipped.

        .. note:: With ``sync=False`` the counters live on the device: one host read.
        """
        return self._read_counts()[0][_SKIPPED]

    @property
    def num_steps(self) -> int:
        """How many :meth:`step` calls completed (skipped steps included)."""
        return self._steps

    def __repr__(self) -> str:
        return (
            f"StepGuard({type(self._optimizer).__name__}, mode={self.mode!r}, by={self.by!r}, "
            f"threshold={self.threshold!r}, norm_type={self.norm_type:g}, sync={self.sync})"
        )

    # ------------------------------------------------------------------------ step

    def step(self, closure: Callable[[], Any] | None = None, *, loss: Any = None) -> StepRecord:
        """Measure the gradients, then take, clip or skip the optimizer step.

        Args:
            closure: for optimizers that need one (LBFGS): the guard calls it once to
                compute the gradients it measures, then passes it to ``optimizer.step``.
            loss: the batch's loss, compared with ``loss_threshold`` (the closure's
                return value is used when this is not given).

        Returns:
            The :class:`StepRecord` of this step.

        Raises:
            RuntimeError: no parameter has a gradient; ``scaler`` misuse.
            ValueError: sparse gradients; ``loss_threshold`` without a loss.
            SkipLimitError: more than ``max_consecutive_skips`` skips in a row.

        .. note::
            ``sync=True`` reads the decision on the host once. ``sync=False`` reads
            nothing except as listed in the class notes.
        """
        if closure is not None:
            with torch.enable_grad():
                closure_loss = closure()
            loss = closure_loss if loss is None else loss
        params, grads = self._params_with_grad()
        if self._loss_threshold is not None and loss is None:
            raise ValueError("this guard has a loss_threshold: call guard.step(loss=loss)")
        scaler_state = self._scaler_state()
        with torch.no_grad():
            found_inf = None if scaler_state is None else _sum_found_inf(scaler_state, params)
            loss_t = None
            if loss is not None and self._loss_threshold is not None:
                loss_t = torch.as_tensor(loss).detach()
                if self._group is not None:
                    loss_t = _distributed.all_reduce_mean(loss_t, self._group)
            # The policies, then the counters, only after a completed step.
            if self.mode == "none":
                stat = self._statistic(grads)
                output = self._take(closure)
                self._update_policies(stat, None, loss_t)
                decision: str | Tensor = "kept"
            else:
                stat, on_device = self._decide(grads, loss_t, found_inf)
                if self.sync:
                    # the one host read of the step
                    decision = _decision_name(on_device, on_device.item())
                    output = None if decision == "skipped" else self._take(closure)
                    self._update_policies(stat, on_device, loss_t)
                    self._count(decision)
                else:
                    try:
                        output = self._step_on_device(params, on_device, closure)
                        self._update_policies(stat, on_device, loss_t)
                        self._count_on_device(on_device)
                    finally:
                        # so that a later bare optimizer.step() is not skipped
                        self._flag.zero_()
                    decision = on_device
            self._recent.append(stat)
        if scaler_state is not None:
            scaler_state["stage"] = OptState.STEPPED
        record = StepRecord(self._steps, stat, decision, output)
        self._steps += 1
        self._last = record
        if self._history is not None:
            self._history.append(record)
        if self._on_record is not None:
            self._on_record(record)
        self._check_skip_limit()
        return record

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad(set_to_none)``."""
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def _params_with_grad(self) -> tuple[list[Tensor], list[Tensor]]:
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
        grads = [p.grad for p in params]
        if any(g.layout != torch.strided for g in grads):
            raise ValueError("StepGuard does not support sparse gradients: use dense ones")
        return params, grads

    def _statistic(self, grads: list[Tensor]) -> Tensor:
        return get_total_norm(
            grads,
            self.norm_type if self.by == "norm" else math.inf,
            process_group=self._norm_group,
        )

    def _decide(
        self, grads: list[Tensor], loss: Tensor | None, found_inf: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """The statistic and the decision, both 0-dim and on the device.

        The decision is a boolean in ``"skip"`` mode (True: keep the step) and a code
        in ``"clip"`` mode (0 kept, 1 clipped, 2 skipped), which also clips the
        gradients, unconditionally. Pure tensor code, no host read (compiles with
        ``fullgraph=True``).
        """
        stat = self._statistic(grads)
        threshold = self._threshold if self._policy is None else self._policy.threshold(stat)
        within = self._within(stat, threshold)
        steppable = []  # further conditions for taking the step at all
        if self.mode == "clip":
            self._clip(grads, stat, threshold)
            steppable.append(torch.isfinite(stat))
            if self._skip_above is not None:
                steppable.append(self._within(stat, self._skip_above))
        # In "skip" mode a non-finite statistic already fails the test `within`.
        if loss is not None:
            limit = (
                self._loss_threshold
                if self._loss_policy is None
                else self._loss_policy.threshold(loss)
            )
            steppable.append(loss.double() <= _as_dtype(limit, torch.float64))
        if found_inf is not None:
            steppable.append(found_inf == 0)
        if self.mode == "skip":
            for condition in steppable:
                within = within & condition
            return stat, self._agreed(within)
        c = self._codes(stat.device)
        code = torch.where(within, c.kept, c.clipped)
        for condition in steppable:
            code = torch.where(condition, code, c.skipped)
        return stat, self._agreed(code)

    def _codes(self, device: torch.device) -> _Codes:
        codes = self._device_codes.get(device)
        if codes is None:
            codes = self._device_codes[device] = _Codes(device)
        return codes

    def _agreed(self, decision: Tensor) -> Tensor:
        """``decision``, or with a process group the ranks' common one (skip wins)."""
        if self._group is None:
            return decision
        if decision.dtype == torch.bool:
            return _distributed.all_reduce_keep(decision, self._group)
        return _distributed.all_reduce_decision(decision, self._group)

    def _within(self, stat: Tensor, threshold: _Fixed | Tensor) -> Tensor:
        """Whether ``stat`` is within ``threshold`` (False for NaN).

        The rule of grad_ignore_norm_ (torch's clip coefficient is at least 1) or of
        grad_ignore_value_; for a fixed threshold, one comparison with the same result.
        """
        if isinstance(threshold, _Fixed):
            return threshold.within(stat)
        return (_keep_by_norm if self.by == "norm" else _keep_by_value)(threshold, stat)

    def _clip(self, grads: list[Tensor], stat: Tensor, threshold: _Fixed | Tensor) -> None:
        """Clip as clip_grad_norm_ or clip_grad_value_ would with this threshold."""
        if self.by == "norm":
            _clip_(_groups(grads), _as_dtype(threshold, stat.dtype), stat, None)
        else:
            _clamp_(_groups(grads), _as_dtype(threshold, torch.float64), None)

    def _take(self, closure: Callable[[], Any] | None) -> Any:
        output = _call_step(self._optimizer, closure)
        if self._scheduler is not None:
            self._scheduler.step()
        return output

    def _step_on_device(self, params: list[Tensor], decision: Tensor, closure: Any) -> Any:
        """Step so that a skip leaves no trace, without reading ``decision`` where possible.

        The decision is written into the skip flag (1.0: skip), which the fused kernels
        read as ``found_inf`` and the device counters add; the caller zeroes it.
        """
        opt, flag = self._optimizer, self._flag
        if decision.dtype == torch.bool:
            torch.logical_not(decision, out=flag)
        else:
            torch.eq(decision, self._codes(decision.device).skipped, out=flag)
        if _has_step_hooks(opt):  # host code: it can only be skipped by not stepping
            return None if bool(flag) else _call_step(opt, closure)
        if self._transaction is not None:
            keep = decision if decision.dtype == torch.bool else torch.eq(flag, 0)
            output, _ = self._transaction.run(params, keep, lambda: _call_step(opt, closure))
            return output
        return self._fused_step(params, closure)

    def _count_on_device(self, decision: Tensor) -> None:
        """Update the device counters (sync=False) from the skip flag, still set."""
        # skipped += flag; consecutive = (consecutive + 1) * flag: one fused update
        torch.addcmul(self._flag, self._skip_tally, self._skip_pair, out=self._skip_tally)
        if decision.dtype != torch.bool:
            self._clip_tally.add_(torch.eq(decision, self._codes(decision.device).clipped))

    def _fused_step(self, params: list[Tensor], closure: Any) -> Any:
        """Step a fused optimizer, whose kernel skips when ``found_inf`` is nonzero.

        ``found_inf`` (the attribute GradScaler sets) is the flag: one tensor written in
        place, never a new attribute value, since an attribute assigned inside a
        compiled region is lost.
        """
        opt = self._optimizer
        if getattr(opt, "found_inf", None) is not self._flag:
            opt.found_inf = self._flag
        # opt.state is a defaultdict: an entry read before the first step is empty.
        fresh = [p for p in params if not opt.state.get(p)]
        output = _call_step(opt, closure)
        created = [p for p in fresh if opt.state.get(p)]
        # A new state entry (the first step) cannot be undone on the device: read once.
        if created and bool(self._flag):
            for p in created:
                del opt.state[p]
        return output

    def _update_policies(self, stat: Tensor, decision: Tensor | None, loss: Tensor | None) -> None:
        """Fold a completed step into the policies (``decision`` None: always taken)."""
        if self._policy is None and self._loss_policy is None:
            return
        if decision is None:
            accepted = self._codes(stat.device).true
        elif decision.dtype == torch.bool:
            accepted = decision
        else:
            accepted = torch.ne(decision, self._codes(decision.device).skipped)
        if self._policy is not None:
            self._policy.update(stat, accepted)
        if self._loss_policy is not None and loss is not None:
            self._loss_policy.update(loss, accepted)

    def _count(self, decision: str) -> None:
        """Update the host counters (sync=True) after a completed step."""
        tally = self._tally
        if decision == "skipped":
            tally[_SKIPS] += 1
            tally[_RUN] += 1
            return
        tally[_RUN] = 0
        if decision == "clipped":
            tally[_CLIPS] += 1

    def _read_tally(self) -> list[int]:
        """[skipped, consecutive skips, clipped]: one host read with sync=False."""
        if isinstance(self._tally, Tensor):
            return [int(v) for v in self._tally.tolist()]
        return list(self._tally)

    def _read_counts(self) -> tuple[list[int], int]:
        """[kept, clipped, skipped] and the current run of skips (one host read, sync=False)."""
        skipped, run, clipped = self._read_tally()
        return [self._steps - skipped - clipped, clipped, skipped], run

    def _check_skip_limit(self) -> None:
        limit = self.max_consecutive_skips
        if limit is None:
            return
        if not self.sync and self._steps % limit:
            return  # sync=False: checked (one host read) every `limit` steps only
        run = int(self._tally[_RUN])
        if run < limit:
            return
        recent = ", ".join(f"{float(v):.4g}" for v in self._recent)
        raise SkipLimitError(
            f"StepGuard skipped {run} steps in a row (max_consecutive_skips={limit}) with "
            f"threshold={self.threshold!r} (mode={self.mode!r}, by={self.by!r}); the last "
            f"statistics were [{recent}]. Raise the threshold, lower the learning rate, or "
            "pass max_consecutive_skips=None."
        )

    # ---------------------------------------------------------------------- scaler

    def _scaler_state(self) -> dict[str, Any] | None:
        """The scaler's record for this step, unscaling first if it was not done."""
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled():
            return None
        states = scaler._per_optimizer_states
        own = states.get(id(self))  # scaler.step(guard) / scaler.unscale_(guard)
        if own is not None and own["stage"] is OptState.UNSCALED:
            return own
        state = states[id(self._optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "StepGuard.step(): this optimizer was already stepped since the last "
                "scaler.update() (guard.step() twice, or scaler.step(optimizer) and "
                "guard.step()). Call scaler.update() once after each guard.step()."
            )
        if state["stage"] is OptState.READY:
            scaler.unscale_(self._optimizer)  # the guard must measure unscaled gradients
        return state

    # ----------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The guard's own state: counters and threshold policies.

        Like :class:`torch.amp.GradScaler`, it holds neither the optimizer's nor the
        scheduler's state: save those as usual.

        .. note:: With ``sync=False`` this reads the device counters on the host.
        """
        counts, run = self._read_counts()
        return {
            "num_steps": self._steps,
            "counts": counts,
            "consecutive_skips": run,
            "threshold": None if self._policy is None else self._policy.state_dict(),
            "loss_threshold": None if self._loss_policy is None else self._loss_policy.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved.

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
        steps, counts = int(state_dict["num_steps"]), [int(n) for n in state_dict["counts"]]
        if len(counts) != len(DECISIONS) or sum(counts) != steps:
            raise ValueError(
                f"state_dict: counts {counts} must be {len(DECISIONS)} numbers (kept, "
                f"clipped, skipped) that add up to num_steps={steps}"
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
        tally = [counts[_SKIPPED], int(state_dict["consecutive_skips"]), counts[_CLIPPED]]
        if isinstance(self._tally, Tensor):
            self._tally.copy_(torch.tensor(tally, dtype=torch.float64))
        else:
            self._tally = tally
        self._steps = steps


# ------------------------------------------------------------------------- helpers


def _check_grad_layout(process_group: Any, grads: str | None) -> None:
    _check_process_group(process_group)
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


def _threshold_arg(
    name: str, value: object, policy: bool = True
) -> tuple[ThresholdPolicy | None, float]:
    """``(policy, nan)`` for a policy, ``(None, number)`` for a valid number."""
    if policy and not isinstance(value, numbers.Number) and isinstance(value, ThresholdPolicy):
        return value, math.nan
    try:
        return None, _check_threshold(name, value)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float: {value!r}") from None


class _Fixed:
    """A fixed threshold as 0-dim float32 and float64 tensors, refilled in place.

    Tensors rather than a Python float so that a compiled decision neither specialises
    nor recompiles on the value; one per dtype so that no conversion runs per step; on
    the guard's device so that no step copies one there (a copy from the host waits for
    the GPU). Given the ``rule`` that keeps a statistic within a threshold, it also
    holds, per dtype, the largest statistic the rule keeps (:func:`_largest_kept`), so
    that the test of a step is one comparison, ``stat <= kept_up_to``, with the rule's
    bits. Inverting the rule costs a few hundred small tensor ops, on the device, at
    each new value: a threshold that changes every step is a :class:`ThresholdPolicy`.
    """

    def __init__(
        self,
        value: float,
        rule: Callable[[Tensor, Tensor], Tensor] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.value = value
        self.f32 = torch.tensor(value, dtype=torch.float32, device=device)
        self.f64 = torch.tensor(value, dtype=torch.float64, device=device)
        self._rule = rule
        if rule is not None:
            self.kept_up_to32 = _largest_kept(self._keeps, torch.float32, device)
            self.kept_up_to64 = _largest_kept(self._keeps, torch.float64, device)

    def fill_(self, value: float) -> None:
        if value == self.value:
            return
        self.value = value
        self.f32.fill_(value)
        self.f64.fill_(value)
        if self._rule is not None:
            device = self.f64.device
            self.kept_up_to32.copy_(_largest_kept(self._keeps, torch.float32, device))
            self.kept_up_to64.copy_(_largest_kept(self._keeps, torch.float64, device))

    def _keeps(self, stat: Tensor) -> Tensor:
        # The float64 value: the rule rounds it to the statistic's dtype where it must.
        return self._rule(self.f64, stat)  # type: ignore[misc]

    def within(self, stat: Tensor) -> Tensor:
        """Whether the rule keeps ``stat``, a 0-dim tensor (False for NaN)."""
        if stat.dtype == torch.float32:
            return torch.le(stat, self.kept_up_to32)
        if stat.dtype == torch.float64:
            return torch.le(stat, self.kept_up_to64)
        return self._keeps(stat)


#: Probes per round of :func:`_largest_kept`, spaced so that none overflows an int64.
_PROBES = 1024


def _largest_kept(
    kept: Callable[[Tensor], Tensor], dtype: torch.dtype, device: torch.device | None = None
) -> Tensor:
    """The largest ``dtype`` number that ``kept`` keeps, as a 0-dim tensor (-inf if none).

    ``kept`` maps a 1-D tensor of statistics to booleans and must be monotone: true up
    to some value, then false, and false for NaN. The guard's rules are: a rounding
    never reverses an order, so ``reciprocal(s + eps) * tau`` cannot grow with ``s``.
    Non-negative floats are ordered as their bit patterns, so this narrows the
    patterns from 0.0 to inf about 1023-fold a round (4 rounds for float32, 7 for
    float64), with tensor ops only: setting a threshold makes no host read.
    """
    bits = _SAME_WIDTH_INT[dtype.itemsize]
    lo = torch.zeros((), dtype=torch.int64, device=device)  # kept, if 0.0 is
    # torch.full, not torch.tensor: no copy from the host (which would wait for a GPU)
    hi = torch.full((), math.inf, dtype=dtype, device=device).view(bits).to(torch.int64)
    offsets = torch.arange(_PROBES, dtype=torch.int64, device=device)
    for _ in range(-(-(8 * dtype.itemsize - 1) // 10)):  # 1023 ** rounds > 2 ** (bits-1)
        step = (hi - lo + _PROBES - 2) // (_PROBES - 1)  # ceil((hi - lo) / 1023)
        probes = torch.minimum(lo + step * offsets, hi)
        n_kept = kept(probes.to(bits).view(dtype)).sum()  # the first n_kept probes are
        above = torch.clamp(n_kept, max=_PROBES - 1).reshape(1)
        hi = torch.where(n_kept < _PROBES, probes.index_select(0, above)[0] - 1, hi)
        lo = probes.index_select(0, torch.clamp(n_kept - 1, min=0).reshape(1))[0]
    largest = lo.to(bits).view(dtype)
    return torch.where(kept(torch.zeros(1, dtype=dtype, device=device))[0], largest, -math.inf)


class _Codes:
    """The decision codes as 0-dim int64 tensors on one device, made once, and True.

    A Python number in a tensor op becomes a new wrapped-scalar tensor on every call,
    which costs several microseconds on the CPU, in every op of every step (and a
    Python bool made a tensor is a copy from the host, which waits for a GPU).
    """

    def __init__(self, device: torch.device) -> None:
        self.kept, self.clipped, self.skipped = (
            torch.tensor(code, dtype=torch.int64, device=device)
            for code in (_KEPT, _CLIPPED, _SKIPPED)
        )
        self.true = torch.ones((), dtype=torch.bool, device=device)


def _as_dtype(threshold: _Fixed | Tensor, dtype: torch.dtype) -> Tensor:
    """The threshold in ``dtype``, rounded as a Python float would be in a tensor op."""
    if isinstance(threshold, _Fixed):
        if dtype == torch.float32:
            return threshold.f32
        return threshold.f64 if dtype == torch.float64 else threshold.f64.to(dtype)
    return threshold.to(dtype)


def _sum_found_inf(state: dict[str, Any], params: list[Tensor]) -> Tensor:
    device = params[0].device
    found = state["found_inf_per_device"].values()
    return (
        torch.stack([f.to(device) for f in found]).sum()
        if found
        else torch.zeros((), device=device)
    )


def _call_step(opt: torch.optim.Optimizer, closure: Callable[[], Any] | None) -> Any:
    return opt.step() if closure is None else opt.step(closure)


def _has_step_hooks(opt: torch.optim.Optimizer) -> bool:
    return bool(
        opt._optimizer_step_pre_hooks
        or opt._optimizer_step_post_hooks
        or _optim_module._global_optimizer_pre_hooks
        or _optim_module._global_optimizer_post_hooks
    )


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
    if not hasattr(scheduler, "optimizer"):
        raise ValueError(
            f"scheduler ({type(scheduler).__name__}) has no .optimizer attribute, so the "
            "guard cannot check that it schedules the guarded optimizer; pass a "
            "torch.optim.lr_scheduler scheduler, or step yours when a step is taken"
        )
    if scheduler.optimizer is not optimizer:
        raise ValueError(
            "scheduler belongs to a different optimizer than the one guarded; its "
            "learning rates would not be the ones used"
        )
