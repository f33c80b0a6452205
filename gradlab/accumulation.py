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
  gradient of the kept micro-batches. :class:`MicroBatchAccumulator` does this.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gradlab._common import (
    TensorOrTensors,
    as_tensor_list,
    check_foreach,
    check_norm_type,
    check_threshold_or_tensor,
)
from gradlab.clip import grad_ignore_norm_, keep_by_norm

__all__ = ["MicroBatchAccumulator"]


class MicroBatchAccumulator:
    r"""Accumulate micro-batch gradients, leaving out each micro-batch that is too large.

    Per-micro-batch ignore: each micro-batch's own gradient is tested as
    :func:`grad_ignore_norm_` tests it, and a bad one (norm above ``max_norm``, NaN or
    inf) contributes nothing. With ``k`` micro-batches of which ``kept`` are kept and
    losses scaled by ``1/k`` as usual, :meth:`finish_` leaves in ``.grad``

    .. math::
        \frac{k}{\text{kept}} \sum_{i\ \text{kept}} \frac{g_i}{k}
        = \frac{1}{\text{kept}} \sum_{i\ \text{kept}} g_i ,

    the mean gradient of the kept micro-batches, as if the bad ones had never been in
    the batch (zero if none is kept). Without the rescaling, dropping one micro-batch
    of four would shrink the step by a quarter.

    The micro-batch's gradient must be alone in ``.grad`` when it is tested, so
    :meth:`add_` moves it into a buffer (one extra copy of the gradients) and sets
    ``.grad`` to None for the next backward. The keep flag is a select (NaN never
    reaches the buffer) and the count of kept micro-batches stays on the device: no
    host read.

    Example::

        acc = gradlab.MicroBatchAccumulator(model.parameters(), max_norm=10.0)
        for x, y in micro_batches:                  # k of them
            (loss_fn(model(x), y) / k).backward()
            acc.add_()
        acc.finish_()                               # .grad: mean of the kept ones
        optimizer.step()

    To clip or ignore the *accumulated* gradient once per optimizer step instead, let
    backward accumulate into ``.grad`` and call :func:`clip_grad_norm_` or
    :func:`grad_ignore_norm_` once before the step: with losses scaled by ``1/k``
    that is clipping the gradient of the full batch.

    Args:
        parameters (Tensor or Iterable[Tensor]): the parameters whose gradients are
            accumulated (a generator is materialised once).
        max_norm (float or Tensor): the largest micro-batch gradient norm kept.
        norm_type (float or str): p, as in :func:`grad_ignore_norm_`. Default: 2.0
        foreach (bool, optional): see :func:`get_total_norm`. Default: None

    Attributes:
        kept (Tensor): 0-dim int64, how many micro-batches were kept so far.
        count (int): how many micro-batches were added so far.
    """

    def __init__(
        self,
        parameters: TensorOrTensors,
        max_norm: float | Tensor,
        norm_type: float | str = 2.0,
        foreach: bool | None = None,
    ) -> None:
        self.params = as_tensor_list(parameters, "parameters")
        self.max_norm = check_threshold_or_tensor("max_norm", max_norm)
        self.norm_type = check_norm_type(norm_type)
        check_foreach(foreach)
        self.foreach = foreach
        self._buffers: list[Tensor | None] = [None] * len(self.params)
        self.kept: Tensor | None = None
        self.count = 0

    def add_(self) -> Tensor:
        """Test the micro-batch gradient now in ``.grad``, add it if kept, clear ``.grad``.

        Returns:
            Tensor: the micro-batch gradient's total norm, 0-dim.
        """
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        # A select: a bad micro-batch leaves +0.0 in .grad, never NaN.
        norm = grad_ignore_norm_(
            [self.params[i] for i in with_grad], self.max_norm, self.norm_type, foreach=self.foreach
        )
        with torch.no_grad():
            for i in with_grad:
                g = self.params[i].grad
                buffer = self._buffers[i]
                if buffer is None:
                    self._buffers[i] = g  # the first gradient becomes the buffer
                else:
                    buffer.add_(g)
                self.params[i].grad = None
            kept = keep_by_norm(norm, self.max_norm).to(torch.int64)
            self.kept = kept if self.kept is None else self.kept + kept.to(self.kept.device)
        self.count += 1
        return norm

    def finish_(self) -> Tensor:
        """Put ``count / kept`` times the accumulated sum into ``.grad``; reset.

        Returns:
            Tensor: 0-dim int64, the number of micro-batches kept.
        """
        kept = self.kept if self.kept is not None else torch.zeros((), dtype=torch.int64)
        with torch.no_grad():
            # count / kept on the device; 0 when nothing was kept (the buffers are 0).
            scale = torch.where(kept > 0, self.count / kept.clamp(min=1), 0.0)
            for p, buffer in zip(self.params, self._buffers, strict=True):
                if buffer is not None:
                    p.grad = buffer.mul_(scale.to(device=buffer.device, dtype=buffer.dtype))
        self._buffers = [None] * len(self.params)
        self.kept, self.count = None, 0
        return kept
