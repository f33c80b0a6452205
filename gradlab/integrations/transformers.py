r"""gradlab in the Hugging Face Transformers ``Trainer``: clip, skip and log.

At each optimizer step the ``Trainer`` (read in transformers 5.24.0,
``Trainer._inner_training_loop``) clips with ``accelerator.clip_grad_norm_`` if
``args.max_grad_norm > 0``, or measures with ``clip_grad_norm_(..., inf)`` otherwise
(``_clip_grad_norm``, ``_get_grad_norm``); then calls ``on_pre_optimizer_step``,
``self.optimizer.step()`` (Accelerate's ``AcceleratedOptimizer``),
``on_optimizer_step``, and steps the learning-rate scheduler unless
``accelerator.optimizer_step_was_skipped``; it logs ``loss``, ``grad_norm`` (before
clipping) and ``learning_rate`` through ``Trainer.log``. On its own it never skips a
step except through fp16's GradScaler: a NaN batch is clipped by a NaN coefficient and
stepped, and the weights become NaN (its ``logging_nan_inf_filter`` only keeps the
NaN out of the logged loss).

:class:`GuardMixin` puts a guard in the optimizer's place::

    class GuardedTrainer(GuardMixin, Trainer):   # or (GuardMixin, SFTTrainer), ...
        pass

    trainer = GuardedTrainer(
        model=model,
        args=TrainingArguments(..., max_grad_norm=0.0),   # the guard clips
        train_dataset=dataset,
        guard=dict(mode="clip", threshold=1.0, skip_above=10.0),
    )

* ``create_optimizer`` (documented as the method to override) wraps whatever optimizer
  the ``Trainer`` builds, or was given in ``optimizers=``, in a
  :class:`~gradlab.integrations.GuardedOptimizer`; so ``self.optimizer.step()`` is
  ``guard.step()``, and ``optimizer.pt`` in every checkpoint carries the guard's state,
  restored on ``train(resume_from_checkpoint=...)``;
* a callback marks a step the guard skipped as skipped for Accelerate in
  ``on_optimizer_step``, before the ``Trainer`` reads ``optimizer_step_was_skipped``,
  so the scheduler does not advance on it (as on a GradScaler skip);
* ``log`` (documented as the method to override to inject behaviour) adds
  :func:`~gradlab.integrations.guard_metrics` to each training log: the clip and skip
  rates land in ``state.log_history``, ``trainer_state.json`` and every ``report_to``
  integration. ``amp_skipped`` counts the steps fp16's GradScaler skipped before the
  guard was reached.

``max_grad_norm``: the ``Trainer`` clips before the guard measures, so a guard that
clips or has a finite threshold needs ``max_grad_norm=0`` (then ``threshold=1.0`` is the
``Trainer``'s ``max_grad_norm=1.0``, bit for bit). A guard with ``mode="skip"`` and an
infinite threshold may keep the ``Trainer``'s clipping: it skips the non-finite steps,
whose clipped gradients stay NaN.
"""

from __future__ import annotations

import math
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "gradlab.integrations.transformers needs Hugging Face Transformers: pip install "
        "'transformers>=5.24,<5.25' (tested with transformers 5.24.0)"
    ) from error

from gradlab.guard import StepGuard
from gradlab.integrations import GuardedOptimizer, guard_metrics

__all__ = ["GuardMixin"]


class GuardMixin:
    r"""Mix a :class:`~gradlab.StepGuard` into a ``transformers.Trainer`` subclass.

    List it before the ``Trainer`` class: ``class GuardedTrainer(GuardMixin, Trainer)``.

    Args:
        *args: the ``Trainer``'s positional arguments.
        guard (dict): the keyword arguments of :class:`~gradlab.StepGuard` but the
            optimizer, e.g. ``dict(mode="clip", threshold=1.0, skip_above=10.0)``. Not
            ``scaler``: under fp16 the ``Trainer``'s GradScaler unscales before the
            guard and skips overflowing steps itself.
        guard_log_prefix (str): put before every logged key. Default: ``"gradlab/"``
        **kwargs: the ``Trainer``'s keyword arguments.

    Attributes:
        guard (StepGuard or None): the guard, once the optimizer exists.
        amp_skipped (int): steps skipped by fp16's GradScaler before reaching the guard.

    Raises:
        ValueError: ``guard`` is not a dict, or it clips or has a finite threshold while
            ``args.max_grad_norm > 0``; when the optimizer is created, any
            :class:`~gradlab.StepGuard` argument error.

    .. note::
        Host reads: the guard's (one per step with ``sync=True``), and those of
        :func:`~gradlab.integrations.guard_metrics` at each log. The ``Trainer`` still
        measures the norm for its own ``grad_norm`` log (``clip_grad_norm_`` with
        ``max_norm=inf``), a second norm computation per step.
    """

    def __init__(
        self, *args: Any, guard: dict[str, Any], guard_log_prefix: str = "gradlab/", **kwargs: Any
    ) -> None:
        if not isinstance(guard, dict):
            raise ValueError(
                "guard must be a dict of StepGuard keyword arguments, e.g. "
                f"dict(mode='clip', threshold=1.0), got {type(guard).__name__}"
            )
        if "scaler" in guard:
            raise ValueError(
                "guard: no scaler; under fp16 the Trainer's own GradScaler unscales before "
                "the guard and skips overflowing steps"
            )
        self.guard_kwargs = dict(guard)
        self.guard_log_prefix = guard_log_prefix
        self.amp_skipped = 0
        super().__init__(*args, **kwargs)
        _check_max_grad_norm(self.args.max_grad_norm, self.guard_kwargs)  # type: ignore[attr-defined]
        self.add_callback(_MarkSkipped(self))  # type: ignore[attr-defined]

    @property
    def guard(self) -> StepGuard | None:
        guarded = _guarded(self.optimizer)
        return None if guarded is None else guarded.guard

    def create_optimizer(self, model: Any = None) -> Any:
        optimizer = super().create_optimizer(model)  # type: ignore[misc]
        if _guarded(optimizer) is None:
            self.optimizer = GuardedOptimizer(StepGuard(optimizer, **self.guard_kwargs))
        return self.optimizer

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        guard = self.guard
        if guard is not None and "loss" in logs:  # a training log, not an evaluation's
            logs.update(guard_metrics(guard, self.guard_log_prefix))
            logs[self.guard_log_prefix + "amp_skipped"] = float(self.amp_skipped)
        super().log(logs, start_time)  # type: ignore[misc]


class _MarkSkipped(TrainerCallback):
    """Tells Accelerate about the guard's skips, and counts GradScaler's."""

    def __init__(self, trainer: GuardMixin) -> None:
        self.trainer = trainer
        self.before: int | None = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        guard = self.trainer.guard
        self.before = None if guard is None else guard.num_steps

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        guard = self.trainer.guard
        if guard is None or self.before is None:
            return
        if guard.num_steps == self.before:
            self.trainer.amp_skipped += 1  # GradScaler skipped without calling step()
        elif guard.last is not None:
            # The Trainer reads accelerator.optimizer_step_was_skipped right after this
            # event. AcceleratedOptimizer.step_was_skipped returns _is_overflow
            # (accelerate/optimizer.py), which only its scaler branch writes, so it is
            # set at every step the guard decided, taken ones included.
            self.trainer.optimizer._is_overflow = guard.last.skipped  # type: ignore[attr-defined]


def _guarded(optimizer: Any) -> GuardedOptimizer | None:
    """The GuardedOptimizer in ``optimizer`` or under Accelerate's wrapper, or None."""
    while optimizer is not None and not isinstance(optimizer, GuardedOptimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def _check_max_grad_norm(max_grad_norm: float, kwargs: dict[str, Any]) -> None:
    if not max_grad_norm or max_grad_norm <= 0:
        return
    mode = kwargs.get("mode", "skip")
    threshold = kwargs.get("threshold", 1.0)
    finite = not (isinstance(threshold, int | float) and math.isinf(threshold))
    if mode == "clip" or (mode == "skip" and finite):
        raise ValueError(
            f"TrainingArguments(max_grad_norm={max_grad_norm!r}) clips before the guard "
            "measures, so the guard would only see clipped gradients: pass "
            "max_grad_norm=0 and let the guard clip (mode='clip', threshold="
            f"{max_grad_norm!r} is the same clipping), or keep it with mode='skip', "
            "threshold=math.inf to skip only non-finite steps"
        )
