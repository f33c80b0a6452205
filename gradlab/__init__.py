"""gradlab: clip, zero or exactly skip exploding gradients, in PyTorch.

* :mod:`gradlab.clip`: norms, clipping and ignoring (zeroing) gradients, as
  ``torch.nn.utils``;
* :mod:`gradlab.skip`: :class:`StepGuard`, which takes, clips or exactly skips a step;
* :mod:`gradlab.adaptive`: thresholds that follow the run, and unit-wise clipping;
* :mod:`gradlab.per_sample`: per-sample clipping and ignoring (DP-SGD), ghost norms;
* :mod:`gradlab.sync`: what counts as a host read, and a detector for it.

The book's own code is :mod:`gradlab.book` (the ``book`` extra); nothing here imports it.
"""

from gradlab.adaptive import AutoClip, SigmaSkip, ThresholdPolicy, ZClip, agc_
from gradlab.clip import (
    MicroBatchAccumulator,
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
    grad_ignore_norm_,
    grad_ignore_value_,
    grad_ignore_with_norm_,
)
from gradlab.per_sample import (
    GhostClipping,
    clip_per_sample_,
    ignore_per_sample_,
    per_sample_grads,
    per_sample_norms,
)
from gradlab.skip import SkipLimitError, StepGuard, StepRecord

__all__ = [
    "AutoClip",
    "GhostClipping",
    "MicroBatchAccumulator",
    "SigmaSkip",
    "SkipLimitError",
    "StepGuard",
    "StepRecord",
    "ThresholdPolicy",
    "ZClip",
    "agc_",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "clip_per_sample_",
    "get_total_norm",
    "grad_ignore_norm_",
    "grad_ignore_value_",
    "grad_ignore_with_norm_",
    "ignore_per_sample_",
    "per_sample_grads",
    "per_sample_norms",
]

__version__ = "0.2.0.dev0"
