r"""Gradient accumulation that leaves out a bad micro-batch.

Gradient accumulation has two meanings:

* clip or ignore the *accumulated* gradient, once per optimizer step: let backward
  accumulate into ``.grad`` over the ``k`` micro-batches, then call
  :func:`gradlab.clip_grad_norm_` or :func:`gradlab.grad_ignore_norm_` before the
  step. With each micro-batch loss scaled by ``1/k``, that is clipping the full
  batch's gradient (the same numbers up to the order of the additions); one bad
  micro-batch loses the whole step;
* drop a bad *micro-batch* from the accumulation: each micro-batch's own gradient is
  tested, and the kept ones are rescaled by ``k / kept``, so that the step is the mean
  gradient of the kept micro-batches. :class:`MicroBatchAccumulator` does this, with
  fp16 loss scaling (:class:`torch.amp.GradScaler`) too.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor
from torch.amp.grad_scaler import OptState

from gradlab._common import (
    TensorOrTensors,
    as_tensor_list,
    check_foreach,
    check_norm_type,
    check_threshold_or_tensor,
    device_groups,
    use_foreach,
)
from gradlab.clip import grad_ignore_norm_, keep_by_norm

__all__ = ["MicroBatchAccumulator"]

#: The scalers whose ``unscale_`` is GradScaler's own. A subclass may do more there
#: (FSDP's ``ShardedGradScaler`` all-reduces ``found_inf`` across ranks), which the
#: accumulator, unscaling each micro-batch itself, would silently leave out.
_PLAIN_SCALERS = (torch.amp.GradScaler, torch.cuda.amp.GradScaler, torch.cpu.amp.GradScaler)


class MicroBatchAccumulator:
    r"""Accumulate micro-batch gradients, leaving out each micro-batch that is too large.

    Per-micro-batch ignore: each micro-batch's own gradient is tested as
    :func:`gradlab.grad_ignore_norm_` tests it, and a bad one (norm above
    ``max_norm``, NaN or inf) contributes nothing. With ``k`` micro-batches of which
    ``kept`` are kept and losses scaled by ``1/k`` as usual, :meth:`finish_` leaves in
    ``.grad``

    .. math::
        \frac{k}{\text{kept}} \sum_{i\ \text{kept}} \frac{g_i}{k}
        = \frac{1}{\text{kept}} \sum_{i\ \text{kept}} g_i ,

    the mean gradient of the kept micro-batches, as if the bad ones had never been in
    the batch (zero if none is kept). Without the rescaling, dropping one micro-batch
    of four would shrink the step by a quarter.

    The micro-batch's gradient must be alone in ``.grad`` when it is tested, so
    :meth:`add_` moves it into a buffer (one extra copy of the gradients) and sets
    ``.grad`` to None for the next backward. A dropped micro-batch is zeroed by a
    select on the bits, never multiplied by 0 (``NaN * 0`` is NaN), so NaN and inf
    never reach the buffer, and the count of kept micro-batches stays on the device.

    **Precision.** The buffer accumulates in each gradient's own dtype, as autograd
    accumulates ``.grad``. :meth:`finish_` divides it by ``kept`` and multiplies it by
    ``k`` in the buffer's dtype for float32 and float64 (never through a float32
    factor), and in float32 for float16 and bfloat16 buffers, rounded once to their
    dtype at the end. For ``k`` a power of two, multiplying by ``k`` is exact, so the
    result is ``k / kept`` times the buffer, correctly rounded to the buffer's dtype.
    That holds for float16 and bfloat16 too: a quotient rounded to q bits and then to
    p bits is the quotient rounded once to p bits when q >= 2p + 2 (S. A. Figueroa,
    "When is double rounding innocuous?", ACM SIGNUM Newsletter 30(3), 1995), and
    float32's q = 24 meets it for their p = 11 and 8.

    **The exact skip.** With ``kept == 0``, ``.grad`` is zero, and
    ``optimizer.step()`` on a zero gradient is not a skip: momentum, weight decay and
    Adam's moments still move the parameters. Step with
    ``gradlab.step_if_(optimizer, kept > 0, sync=False)``, which then leaves the
    parameters and every optimizer-state tensor as if the step had never come.

    **GradScaler** (fp16 loss scaling). Given ``scaler=``, :meth:`add_` unscales each
    micro-batch's gradient in ``.grad`` (with GradScaler's own kernel and its
    ``1 / scale``), records whether it was finite, and tests the *unscaled* gradient
    against ``max_norm``. :meth:`finish_` then plays ``scaler.unscale_(optimizer)``'s
    part for ``optimizer``: it hands the scaler the ``found_inf`` of the micro-batches
    (nonzero if any overflowed) and marks the optimizer's gradients unscaled. So
    ``scaler.update()`` backs off the scale exactly when GradScaler would have without
    the accumulator (any micro-batch overflowed), and grows it as it would. The
    recipe, with ``device`` the model's device::

        scaler = torch.amp.GradScaler(device.type)
        acc = gradlab.MicroBatchAccumulator(model.parameters(), max_norm=10.0, scaler=scaler)
        for x, y in micro_batches:                         # k of them
            with torch.autocast(device.type, dtype=torch.float16):
                loss = loss_fn(model(x), y) / k
            scaler.scale(loss).backward()
            acc.add_()                                     # unscale, test, move to the buffer
        kept = acc.finish_(optimizer)                      # .grad: mean of the kept ones
        gradlab.step_if_(optimizer, kept > 0, sync=False)  # none kept: no step at all
        scaler.update()                                    # backs off if one overflowed
        optimizer.zero_grad()

    The same loop runs without loss scaling: a ``GradScaler(enabled=False)`` (as
    bfloat16 and float32 runs often have) leaves ``scale`` and ``update`` no-ops and
    the accumulator unscales nothing; or leave out the scaler lines altogether.

    After ``finish_(optimizer)`` with an enabled scaler, the optimizer is in
    GradScaler's "unscaled" stage:

    * ``scaler.unscale_(optimizer)`` raises RuntimeError, as after any unscale: the
      gradients are never unscaled twice. Do not call it.
    * ``scaler.step(optimizer)`` does not unscale again (a fused optimizer is not
      given the scale either) and, as GradScaler always does, skips the whole step if
      any micro-batch overflowed (one host read). It does not know ``kept``: with
      ``kept == 0`` and no overflow (every micro-batch over ``max_norm``), it steps on
      the zero gradient. ``step_if_`` above instead steps on the kept micro-batches
      and skips exactly when none is kept.
    * ``StepGuard(optimizer, scaler=scaler).step()`` likewise sees the gradients as
      unscaled, does not unscale them again, and skips on overflow; it measures the
      accumulated gradient, so with ``kept == 0`` it sees a norm of 0 and takes the
      zero-gradient step: use ``step_if_`` as above for the accumulator's step.
    * Call ``scaler.update()`` once after the step, as always; the next
      accumulation needs the optimizer back in the "ready" stage.

    GradScaler has no public call for "these gradients are unscaled, and this is their
    ``found_inf``": :meth:`finish_` writes the scaler's per-optimizer state
    (``_per_optimizer_states``), as :class:`gradlab.StepGuard` does, and the tests
    hold it to torch's own GradScaler, state for state.

    To clip or ignore the *accumulated* gradient once per optimizer step instead, let
    backward accumulate into ``.grad`` and call :func:`gradlab.clip_grad_norm_` or
    :func:`gradlab.grad_ignore_norm_` once before the step (after
    ``scaler.unscale_(optimizer)``): with losses scaled by ``1/k`` that is clipping
    the gradient of the full batch.

    Args:
        parameters (Tensor or Iterable[Tensor]): the parameters whose gradients are
            accumulated, each once (a generator is materialised once).
        max_norm (float or Tensor): the largest micro-batch gradient norm kept, a
            non-negative number (inf allowed), or a 0-dim tensor, used on the device
            as it is. With a scaler, it is compared with the unscaled gradient.
        norm_type (float or str): p, as in :func:`gradlab.grad_ignore_norm_`.
            Default: 2.0
        foreach (bool, optional): see :func:`gradlab.get_total_norm` (used for the
            norm, the zeroing and the rescaling). Default: None
        scaler (torch.amp.GradScaler, optional): the scaler of the micro-batch losses
            (see above). A subclass with its own unscaling, such as FSDP's
            ``ShardedGradScaler``, is refused. Default: None

    Attributes:
        kept (Tensor or None): 0-dim int64 on the first gradient's device, how many
            micro-batches were kept so far; None before the first :meth:`add_`.
        count (int): how many micro-batches were added so far.

    Raises:
        ValueError: a bad ``max_norm``, ``norm_type``, ``foreach`` or ``scaler``, or
            ``parameters`` that are not tensors or hold one tensor twice, named,
            before anything changes.

    .. note::
        No host read, in :meth:`add_` or :meth:`finish_`, with or without a scaler.
    """

    def __init__(
        self,
        parameters: TensorOrTensors,
        max_norm: float | Tensor,
        norm_type: float | str = 2.0,
        foreach: bool | None = None,
        *,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        # The arguments first, so that a bad one leaves a generator of parameters unread.
        max_norm = check_threshold_or_tensor("max_norm", max_norm)
        norm_type = check_norm_type(norm_type)
        check_foreach(foreach)
        if scaler is not None and type(scaler) not in _PLAIN_SCALERS:
            kind = "a subclass" if isinstance(scaler, torch.amp.GradScaler) else "not"
            raise ValueError(
                f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__} "
                f"({kind} of torch.amp.GradScaler; a subclass's own unscale_, such as "
                "ShardedGradScaler's all-reduce of found_inf, would be bypassed)"
            )
        params = as_tensor_list(parameters, "parameters")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("parameters holds the same tensor more than once")
        self.params = params
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.foreach = foreach
        # A disabled scaler (enabled=False) scales nothing: then there is nothing to unscale.
        self._scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._buffers: list[Tensor | None] = [None] * len(params)
        self._found_inf: dict[torch.device, Tensor] = {}
        self.kept: Tensor | None = None
        self.count = 0

    def add_(self) -> Tensor:
        """Test the micro-batch gradient now in ``.grad``, add it if kept, clear ``.grad``.

        With a scaler, the gradient is unscaled in place first (GradScaler's kernel,
        which also records a non-finite entry for :meth:`finish_`), and the unscaled
        gradient is tested and accumulated.

        Returns:
            Tensor: the micro-batch gradient's total norm (unscaled with a scaler),
            0-dim, before the decision; NaN or inf for a gradient that is not finite.

        Raises:
            ValueError: a sparse gradient; with an enabled scaler, a float16 gradient
                (GradScaler refuses to unscale those too). Checked before anything
                changes.
            RuntimeError: an enabled scaler that has not scaled a loss yet.

        .. note::
            No host read.
        """
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        params = [self.params[i] for i in with_grad]
        grads = [cast(Tensor, p.grad) for p in params]  # the ones with a gradient
        self._check_grads(grads)
        with torch.no_grad():
            if self._scaler is not None:
                self._unscale_(self._scaler, grads)
            # A select: a bad micro-batch leaves +0.0 in .grad, never NaN.
            norm = grad_ignore_norm_(params, self.max_norm, self.norm_type, foreach=self.foreach)
            for i, p, g in zip(with_grad, params, grads, strict=True):
                buffer = self._buffers[i]
                if buffer is None:
                    self._buffers[i] = g  # the first gradient becomes the buffer
                else:
                    buffer.add_(g)
                p.grad = None
            kept = keep_by_norm(norm, self.max_norm).to(torch.int64)
            self.kept = kept if self.kept is None else self.kept + kept.to(self.kept.device)
        self.count += 1
        return norm

    def _check_grads(self, grads: list[Tensor]) -> None:
        if any(g.layout != torch.strided for g in grads):
            raise ValueError("MicroBatchAccumulator: sparse gradients are not supported")
        if self._scaler is None:
            return
        if any(g.dtype == torch.float16 for g in grads):
            # GradScaler.unscale_ raises "Attempting to unscale FP16 gradients." for the
            # same reason: 1 / scale would underflow them. Autocast keeps float32 weights.
            raise ValueError(
                "MicroBatchAccumulator with an enabled scaler: float16 gradients cannot be "
                "unscaled (GradScaler refuses them too); keep the parameters in float32 "
                "and run the forward under torch.autocast"
            )
        if self._scaler._get_scale_async() is None:
            raise RuntimeError(
                "MicroBatchAccumulator.add_(): the scaler has no scale yet; call "
                "scaler.scale(loss).backward() before add_()"
            )

    def _unscale_(self, scaler: torch.amp.GradScaler, grads: list[Tensor]) -> None:
        """``grads *= 1 / scale`` in place, as ``GradScaler.unscale_``; flags non-finite."""
        scale = scaler._get_scale_async()
        assert scale is not None  # add_ checked it
        # GradScaler.unscale_'s reciprocal, bit for bit (float64 except on MPS).
        if scale.device == torch.device("mps:0"):
            inv_scale = scale.reciprocal()
        else:
            inv_scale = scale.double().reciprocal().float()
        for device, _, group in device_groups(grads):
            found_inf = self._found_inf.get(device)
            if found_inf is None:
                found_inf = torch.zeros((), dtype=torch.float32, device=device)
                self._found_inf[device] = found_inf
            # Sets found_inf to 1 on a non-finite entry, never back to 0: an OR over
            # the micro-batches, which is what the accumulated sum would have shown.
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale.to(device))

    def finish_(self, optimizer: torch.optim.Optimizer | None = None) -> Tensor:
        r"""Put the mean of the kept micro-batch gradients into ``.grad``; reset.

        ``.grad`` becomes :math:`\frac{\text{count}}{\text{kept}}` times the
        accumulated sum (zero when nothing was kept); see the class notes for the
        rounding. With an enabled scaler, ``optimizer``'s state in the scaler is then
        what ``scaler.unscale_(optimizer)`` would have left: its ``found_inf`` (nonzero
        if any micro-batch overflowed) and the "unscaled" stage.

        Args:
            optimizer (torch.optim.Optimizer, optional): the optimizer that steps
                these parameters. Required with an enabled scaler; when given, every
                parameter that was accumulated must be one of its parameters, and
                (with an enabled scaler) every one of its parameters that has a
                ``.grad`` must be one of the accumulator's, since that gradient is
                still scaled. Default: None

        Returns:
            Tensor: 0-dim int64, the number of micro-batches kept. Step with
            ``gradlab.step_if_(optimizer, kept > 0, sync=False)``.

        Raises:
            TypeError: ``optimizer`` is not a :class:`torch.optim.Optimizer`.
            ValueError: no ``optimizer`` with an enabled scaler; parameters that do
                not match it; a parameter with a ``.grad`` that :meth:`add_` has not
                taken (a backward after the last :meth:`add_`).
            RuntimeError: ``scaler.unscale_`` or ``scaler.step`` was already called for
                ``optimizer`` since the last ``scaler.update()``. Each error is raised
                before anything changes.

        .. note::
            No host read.
        """
        state = self._check_finish(optimizer)
        kept = self.kept if self.kept is not None else torch.zeros((), dtype=torch.int64)
        with torch.no_grad():
            self._rescale_(kept)
        if state is not None:
            state["found_inf_per_device"] = self._found_inf
            state["stage"] = OptState.UNSCALED
        self._buffers = [None] * len(self.params)
        self._found_inf = {}
        self.kept, self.count = None, 0
        return kept

    def _check_finish(self, optimizer: object) -> dict[str, Any] | None:
        """Check :meth:`finish_`'s preconditions; the scaler's state for ``optimizer``."""
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
            )
        for i, (p, buffer) in enumerate(zip(self.params, self._buffers, strict=True)):
            if buffer is not None and p.grad is not None:
                raise ValueError(
                    f"parameter {i} has a .grad that add_() has not taken (a backward after "
                    "the last add_()): call add_() after every backward"
                )
        if optimizer is None:
            if self._scaler is not None:
                raise ValueError(
                    "finish_() needs the optimizer with an enabled scaler: "
                    "acc.finish_(optimizer), in place of scaler.unscale_(optimizer)"
                )
            return None
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for i, (p, buffer) in enumerate(zip(self.params, self._buffers, strict=True)):
            if buffer is not None and id(p) not in stepped:
                raise ValueError(
                    f"parameter {i} of the accumulator is not a parameter of optimizer"
                )
        if self._scaler is None:
            return None
        mine = {id(p) for p in self.params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in mine:
                    raise ValueError(
                        "optimizer has a parameter with a .grad that the accumulator does not "
                        "hold: that gradient is still scaled. Give the accumulator all of the "
                        "optimizer's parameters"
                    )
        state = self._scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "finish_(): scaler.unscale_(optimizer) was already called since the last "
                "update(); with the accumulator, finish_(optimizer) replaces it"
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "finish_(): the optimizer was already stepped since the last "
                "scaler.update(); call scaler.update() once after each step"
            )
        return state

    def _rescale_(self, kept: Tensor) -> None:
        """Each buffer <- buffer / max(kept, 1) * count, in float32 at least (see above)."""
        buffers = [b for b in self._buffers if b is not None]
        denominator = kept.clamp(min=1)  # 0 kept: the buffers are all zero, and stay so
        for device, dtype, group in device_groups(buffers):
            work = torch.promote_types(dtype, torch.float32)
            divisor = denominator.to(device=device, dtype=work)
            wide = group if work == dtype else [b.to(work) for b in group]
            if use_foreach(group, device, self.foreach):
                torch._foreach_div_(wide, divisor)
                torch._foreach_mul_(wide, self.count)
                if wide is not group:
                    torch._foreach_copy_(group, wide)
            else:
                for b, w in zip(group, wide, strict=True):
                    w.div_(divisor).mul_(self.count)
                    if w is not b:
                        b.copy_(w)
        for p, buffer in zip(self.params, self._buffers, strict=True):
            if buffer is not None:
                p.grad = buffer
