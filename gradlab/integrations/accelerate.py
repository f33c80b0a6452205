r"""gradlab in Hugging Face Accelerate: the guard in place of clip, step and scaler.

Accelerate's loop (read in accelerate 1.15.0) is the user's own::

    accelerator.backward(loss)                       # scaler.scale(loss).backward() in fp16
    if accelerator.sync_gradients:
        accelerator.clip_grad_norm_(params, 1.0)     # unscale_gradients(), then torch's clip
    optimizer.step()                                 # AcceleratedOptimizer.step
    scheduler.step()                                 # AcceleratedScheduler.step

``AcceleratedOptimizer.step`` (``accelerate/optimizer.py``) steps only when
``gradient_state.sync_gradients``; with a GradScaler it calls ``scaler.step`` then
``scaler.update()`` and sets ``_is_overflow`` when the scaler skipped, which
``step_was_skipped`` and so ``accelerator.optimizer_step_was_skipped`` report
(``accelerate/accelerator.py``), and ``AcceleratedScheduler.step`` does not advance after
a skipped step (``accelerate/scheduler.py``). Without a scaler nothing is ever skipped.

:class:`AcceleratedGuard` replaces the clip and the step with one call::

    guard = AcceleratedGuard(optimizer, mode="clip", threshold=1.0, skip_above=10.0)
    accelerator.register_for_checkpointing(guard)
    ...
        accelerator.backward(loss)
        guard.step()          # None while accumulating; else the StepRecord
        scheduler.step()      # skipped when the guard or the scaler skipped
        optimizer.zero_grad()

It guards the optimizer inside the prepared one, with Accelerate's scaler as its
``scaler``: it unscales, skips an overflow as GradScaler does, refuses a stray
``optimizer.step()`` while a scaler is on, then calls ``scaler.update()`` as
``AcceleratedOptimizer.step`` does, and marks the step skipped for Accelerate when the
guard skipped it. The decision is read on the host (``sync=True``), as Accelerate's
skip flag is a host bool.
"""

from __future__ import annotations

from typing import Any

try:
    from accelerate.optimizer import AcceleratedOptimizer
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "gradlab.integrations.accelerate needs Hugging Face Accelerate: pip install "
        "'accelerate>=1.15,<1.16' (tested with accelerate 1.15.0)"
    ) from error

from gradlab.guard import StepGuard, StepRecord

__all__ = ["AcceleratedGuard"]


class AcceleratedGuard(StepGuard):
    r"""A :class:`~gradlab.StepGuard` of an Accelerate-prepared optimizer.

    ``step()`` is a no-op returning ``None`` on a micro-batch that only accumulates
    (``accelerator.sync_gradients`` false, as ``AcceleratedOptimizer.step`` is); on the
    last micro-batch it measures, clips or skips as a :class:`~gradlab.StepGuard`, then
    calls ``scaler.update()`` if Accelerate has a scaler, and sets
    ``optimizer.step_was_skipped`` to the decision, so that
    ``accelerator.optimizer_step_was_skipped`` is true after a skip and a prepared
    scheduler does not advance. Call it instead of ``accelerator.clip_grad_norm_`` and
    ``optimizer.step()``; with a scaler, a stray ``optimizer.step()`` raises.

    ``state_dict()`` and ``load_state_dict()`` are the guard's:
    ``accelerator.register_for_checkpointing(guard)`` saves and restores it with
    ``accelerator.save_state`` / ``load_state``.

    Args:
        optimizer (AcceleratedOptimizer): what ``accelerator.prepare`` returned for the
            optimizer.
        mode, by, threshold, norm_type: as :class:`~gradlab.StepGuard`.
        **kwargs: the other keyword arguments of :class:`~gradlab.StepGuard`, except
            ``scaler`` (Accelerate's is used) and ``sync`` (always True).

    Raises:
        TypeError: ``optimizer`` was not prepared by Accelerate.
        ValueError: ``scaler`` or ``sync=False`` given; any :class:`~gradlab.StepGuard`
            argument error.

    .. note::
        Host reads: one per step, the decision (the scaler's ``found_inf`` is read with
        it), as ``AcceleratedOptimizer.step`` with a scaler reads ``found_inf`` once.
    """

    def __init__(
        self,
        optimizer: AcceleratedOptimizer,
        mode: str = "skip",
        by: str = "norm",
        threshold: Any = 1.0,
        norm_type: float | str = 2.0,
        **kwargs: Any,
    ) -> None:
        if not isinstance(optimizer, AcceleratedOptimizer):
            raise TypeError(
                "optimizer must be the AcceleratedOptimizer that accelerator.prepare "
                f"returned, got {type(optimizer).__name__}"
            )
        if "scaler" in kwargs:
            raise ValueError("scaler: AcceleratedGuard uses Accelerate's own (optimizer.scaler)")
        if kwargs.get("sync", True) is not True:
            raise ValueError(
                "sync=False: Accelerate's step_was_skipped and its scheduler are host code, "
                "so the decision is read on the host; use sync=True"
            )
        kwargs.pop("sync", None)
        super().__init__(
            optimizer.optimizer, mode, by, threshold, norm_type, scaler=optimizer.scaler, **kwargs
        )
        self.accelerated = optimizer

    def step(self, closure: Any = None, *, loss: Any = None, keep: Any = None) -> StepRecord | None:  # type: ignore[override]
        """Take, clip or skip the step at a gradient-sync micro-batch; ``None`` otherwise.

        Args and raises: as :meth:`StepGuard.step`.

        Returns:
            StepRecord or None: the record, or ``None`` while gradients accumulate.
        """
        if not self.accelerated.gradient_state.sync_gradients:
            return None
        record = super().step(closure, loss=loss, keep=keep)
        if self.accelerated.scaler is not None:
            self.accelerated.scaler.update()
        # AcceleratedOptimizer.step_was_skipped returns _is_overflow, which only its own
        # scaler branch writes (accelerate/optimizer.py); the guard's skip joins it.
        self.accelerated._is_overflow = record.skipped
        return record
