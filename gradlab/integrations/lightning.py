r"""gradlab in PyTorch Lightning: an exact skip inside ``Trainer.fit``.

Lightning's automatic optimization calls the optimizer itself (read in lightning 2.6.6):
``LightningModule.optimizer_step`` calls ``optimizer.step(closure=optimizer_closure)``
(``lightning/pytorch/core/module.py``), and the precision plugin runs the closure
(``training_step``, ``backward``), then ``on_before_optimizer_step`` and
``configure_gradient_clipping``, then the raw optimizer's step
(``plugins/precision/precision.py``, ``Precision._wrap_closure`` and
``Precision.optimizer_step``). With ``"16-mixed"`` it unscales first and calls
``scaler.step(optimizer)`` then ``scaler.update()`` (``plugins/precision/amp.py``,
``MixedPrecision.optimizer_step``). No hook lies between the gradients and the update
that can cancel the update, so the skip lives in the optimizer Lightning is given::

    def configure_optimizers(self):
        inner = torch.optim.AdamW(self.parameters(), lr=1e-3)
        guard = gradlab.StepGuard(inner, mode="clip", threshold=1.0, skip_above=10.0)
        return GuardedOptimizer(guard)

    trainer = L.Trainer(callbacks=[GuardCallback()])   # no gradient_clip_val: the guard clips

The same object serves manual optimization (``opt.step()`` after
``self.manual_backward(loss)``), ``"bf16-mixed"`` and ``"16-mixed"``: there Lightning
unscales the gradients before the guard measures them, and its GradScaler skips an
overflowing step without calling ``step()`` at all (an exact skip of its own) and backs
off. :class:`GuardCallback` logs the decisions, counts those GradScaler skips, and sets
:attr:`GuardedOptimizer.step_was_skipped` for both, for a ``lr_scheduler_step`` that
should not advance on a skipped step. The guard's state rides in the optimizer's state
dict, so Lightning's checkpoints keep it.

Clipping alone needs no adapter: override ``configure_gradient_clipping`` and call
:func:`gradlab.clip_grad_norm_` on the optimizer's parameters, as Lightning's own
``Precision.clip_grad_by_norm`` calls ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "gradlab.integrations.lightning needs PyTorch Lightning: pip install "
        "'lightning>=2.6,<2.7' (tested with lightning 2.6.6)"
    ) from error

from gradlab.integrations import GuardedOptimizer, guard_metrics

__all__ = ["GuardCallback", "GuardedOptimizer"]


class GuardCallback(pl.Callback):
    r"""Log every :class:`~gradlab.integrations.GuardedOptimizer`'s decisions in Lightning.

    At each training batch that stepped, logs :func:`~gradlab.integrations.guard_metrics`
    with ``self.log`` (so every Lightning logger gets them, at ``log_every_n_steps``),
    plus ``amp_skipped``: the steps a GradScaler skipped for overflow before the guard
    was reached (``"16-mixed"``). With several guarded optimizers, the keys of the i-th
    carry ``prefix`` + ``f"{i}/"``.

    Before each step it sets the optimizer's ``step_was_skipped``, which the guard then
    overwrites with its own decision: if the GradScaler skips, the step stays marked
    skipped. A scheduler that should not advance on a skipped step::

        def lr_scheduler_step(self, scheduler, metric):
            if not self.trainer.optimizers[0].step_was_skipped:
                scheduler.step()

    At ``on_fit_start`` it refuses a ``Trainer(gradient_clip_val=...)``: Lightning would
    clip in ``configure_gradient_clipping`` before the guard measures, so the guard would
    never see a norm above the clip value (give the guard ``mode="clip"`` instead).

    Args:
        prefix (str): put before every logged key. Default: ``"gradlab/"``
        prog_bar (bool): show the metrics in the progress bar. Default: False

    Raises:
        ValueError: at ``on_fit_start``, no optimizer is a ``GuardedOptimizer``, or
            ``gradient_clip_val`` is set.

    .. note::
        Host reads: those of :func:`~gradlab.integrations.guard_metrics`, once per
        stepping batch.
    """

    def __init__(self, prefix: str = "gradlab/", prog_bar: bool = False) -> None:
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a str, got {type(prefix).__name__}")
        self.prefix = prefix
        self.prog_bar = bool(prog_bar)
        self.amp_skipped: list[int] = []
        self._guarded: list[GuardedOptimizer] = []
        self._before: dict[int, int] = {}  # optimizer index -> guard.num_steps before its step

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._guarded = [o for o in trainer.optimizers if isinstance(o, GuardedOptimizer)]
        if not self._guarded:
            raise ValueError(
                "GuardCallback: no optimizer is a gradlab GuardedOptimizer; return "
                "GuardedOptimizer(gradlab.StepGuard(optimizer, ...)) from configure_optimizers"
            )
        if trainer.gradient_clip_val:
            raise ValueError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val!r}) clips in "
                "configure_gradient_clipping, before the guard measures the gradients; "
                "leave it unset and give the guard mode='clip', threshold="
                f"{trainer.gradient_clip_val!r} (the same clipping)"
            )
        saved = self.amp_skipped
        self.amp_skipped = saved if len(saved) == len(self._guarded) else [0] * len(self._guarded)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # Called after unscale_ and before scaler.step (plugins/precision/amp.py), and
        # inside the closure before the raw step otherwise (precision.py, _after_closure).
        for i, guarded in enumerate(self._guarded):
            if optimizer is guarded:
                guarded.step_was_skipped = True  # until the guard decides
                self._before[i] = guarded.guard.num_steps

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._before:
            return  # an accumulating batch: no step
        metrics: dict[str, float] = {}
        for i, guarded in enumerate(self._guarded):
            if i in self._before and guarded.guard.num_steps == self._before[i]:
                self.amp_skipped[i] += 1  # the GradScaler skipped before the guard
            prefix = self.prefix if len(self._guarded) == 1 else f"{self.prefix}{i}/"
            metrics.update(guard_metrics(guarded.guard, prefix))
            metrics[prefix + "amp_skipped"] = float(self.amp_skipped[i])
        self._before.clear()
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=self.prog_bar)

    def state_dict(self) -> dict[str, Any]:
        return {"amp_skipped": list(self.amp_skipped)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Restored before configure_optimizers runs (trainer.py, _run): kept until
        # on_fit_start matches it to the optimizers.
        self.amp_skipped = [int(n) for n in state_dict["amp_skipped"]]
