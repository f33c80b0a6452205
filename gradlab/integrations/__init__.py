r"""gradlab in the trainers people use: thin adapters, one module per trainer.

``import gradlab`` imports none of this package, and this package itself needs torch
only. Each trainer's module imports its trainer when it is imported, so a missing
trainer is an :class:`ImportError` naming the extra to install:

* ``gradlab.integrations.lightning``: ``GuardCallback``,
  with :class:`GuardedOptimizer` returned from ``configure_optimizers``;
* ``gradlab.integrations.accelerate``:
  ``AcceleratedGuard``, a guard of the prepared
  optimizer that replaces ``accelerator.clip_grad_norm_`` and ``optimizer.step()``;
* ``gradlab.integrations.transformers``:
  ``GuardMixin`` for a ``Trainer``;
* torchtitan needs no adapter: its ``train_step`` calls the library's two phases
  (:func:`gradlab.keep_by_norm`, :func:`gradlab.step_if_`) directly.

What is here is shared by them:

* :class:`GuardedOptimizer`: an optimizer whose ``step()`` is ``guard.step()``, for the
  trainers that call ``optimizer.step()`` themselves (Lightning, the ``Trainer``); its
  ``state_dict()`` carries the guard's state, so the trainer's own checkpoints keep it;
* :func:`guard_metrics`: the guard's counters and rates as plain floats, for a
  trainer's logger.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradlab.guard import StepGuard, StepRecord

__all__ = ["GUARD_STATE_KEY", "GuardedOptimizer", "guard_metrics"]

#: The key under which :meth:`GuardedOptimizer.state_dict` stores the guard's state.
GUARD_STATE_KEY = "gradlab_guard"


class GuardedOptimizer(torch.optim.Optimizer):
    r"""An optimizer whose ``step()`` measures, then takes, clips or skips, by a guard.

    For trainers that own the call to ``optimizer.step()``: give them this object in
    place of the optimizer, and every step they take goes through ``guard.step()``.

    .. code-block:: python

        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = gradlab.StepGuard(inner, mode="clip", threshold=1.0, skip_above=10.0)
        optimizer = GuardedOptimizer(guard)   # hand this to the trainer

    ``step(closure)`` calls the closure once (under :func:`torch.enable_grad`, as
    torch's optimizers do), then ``guard.step``; an optimizer that evaluates the closure
    again (LBFGS) gets fresh evaluations, clipped as the first. A closure that leaves no
    gradient (Lightning's ``training_step`` returning ``None``) steps nothing, as a torch
    optimizer would, and records nothing. Everything else (``param_groups``, ``state``,
    ``defaults``, ``zero_grad``, ``add_param_group``) is the inner optimizer's, so a
    learning-rate scheduler built on this object drives the inner one.

    It does not claim ``_step_supports_amp_scaling`` even when the inner optimizer is
    fused: a :class:`torch.amp.GradScaler` in the trainer therefore unscales the
    gradients before the guard measures them, reads its ``found_inf`` and skips an
    overflowing step without calling ``step()`` (its own exact skip), exactly as it does
    for a plain optimizer. Build the guard without ``scaler=`` then: the trainer's
    precision code owns the scaler.

    Args:
        guard (StepGuard): the guard of the inner optimizer, without a ``scaler``.

    Attributes:
        guard (StepGuard): the guard.
        last (StepRecord or None): the record of the latest ``step()`` that reached the
            guard.
        step_was_skipped (bool): whether the latest step was skipped, by the guard or,
            where a trainer marks it (``gradlab.integrations.lightning``), by a
            GradScaler; the name and meaning of Accelerate's
            ``AcceleratedOptimizer.step_was_skipped``.

    .. note::
        Host reads: those of ``guard.step()`` (one with ``sync=True``).
    """

    def __init__(self, guard: StepGuard) -> None:
        if not isinstance(guard, StepGuard):
            raise TypeError(f"guard must be a gradlab.StepGuard, got {type(guard).__name__}")
        if guard._scaler is not None:
            raise ValueError(
                "guard has a scaler: a trainer that calls optimizer.step() also runs its own "
                "GradScaler (unscale_, step, update), which would unscale twice; build the "
                "guard without scaler= and let the trainer's scaler skip overflowing steps"
            )
        # torch.optim.Optimizer.__init__ is not called, as accelerate's AcceleratedOptimizer
        # does not: every piece of optimizer state below is the inner optimizer's.
        self.guard = guard
        self.last: StepRecord | None = None
        self.step_was_skipped = False

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer."""
        return self.guard.optimizer

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``guard.step()``, after the closure if one is given.

        Returns:
            The closure's first value (``None`` without a closure).
        """
        if closure is None:
            self._record(self.guard.step())
            return None
        with torch.enable_grad():
            loss = closure()
        if not any(p.grad is not None for g in self.param_groups for p in g["params"]):
            # Nothing to step: torch's optimizers leave a parameter without .grad alone.
            self.step_was_skipped = True
            return loss
        evaluations = 0

        def replay() -> Any:
            # The guard calls this first to measure the gradients the closure just made;
            # further calls (LBFGS) evaluate afresh.
            nonlocal evaluations
            evaluations += 1
            return loss if evaluations == 1 else closure()

        self._record(self.guard.step(replay))
        return loss

    def _record(self, record: StepRecord) -> None:
        self.last = record
        self.step_was_skipped = record.skipped

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict, with the guard's under :data:`GUARD_STATE_KEY`.

        .. note:: With ``sync=False`` this reads the guard's device counters on the host.
        """
        state = self.optimizer.state_dict()
        state[GUARD_STATE_KEY] = self.guard.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load both; a state dict without the guard's key loads the optimizer alone.

        If either part is refused, neither changes.
        """
        state = dict(state_dict)
        guard_state = state.pop(GUARD_STATE_KEY, None)
        if guard_state is None:
            self.optimizer.load_state_dict(state)
            return
        before = self.guard.state_dict()
        self.guard.load_state_dict(guard_state)  # checked whole before it changes anything
        try:
            self.optimizer.load_state_dict(state)
        except BaseException:
            self.guard.load_state_dict(before)
            raise

    def __repr__(self) -> str:
        return f"GuardedOptimizer({self.guard!r})"


def guard_metrics(guard: StepGuard, prefix: str = "gradlab/") -> dict[str, float]:
    r"""The guard's counters, rates and latest statistic, as floats for a logger.

    Keys (after ``prefix``): ``steps``, ``kept``, ``clipped``, ``skipped``,
    ``consecutive_skips``, ``clip_rate`` and ``skip_rate`` (of all steps so far, 0 before
    the first) and, once a step was made, ``total_norm`` (the latest statistic, before
    clipping; NaN or inf on a bad step).

    Args:
        guard (StepGuard): the guard.
        prefix (str): put before every key. Default: ``"gradlab/"``

    Returns:
        dict[str, float]: the metrics.

    .. note::
        Host reads: one for the counters with ``sync=False`` (none with ``sync=True``),
        and one for the latest record if it is still pending.
    """
    state = guard.state_dict()
    kept, clipped, skipped = state["counts"]
    steps = state["num_steps"]
    values = {
        "steps": steps,
        "kept": kept,
        "clipped": clipped,
        "skipped": skipped,
        "consecutive_skips": state["consecutive_skips"],
        "clip_rate": clipped / steps if steps else 0.0,
        "skip_rate": skipped / steps if steps else 0.0,
    }
    if guard.last is not None:
        values["total_norm"] = guard.last.total_norm
    return {prefix + name: float(value) for name, value in values.items()}
