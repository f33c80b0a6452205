"""gradlab: clip, zero or exactly skip exploding gradients, in PyTorch.

* :mod:`gradlab.clip`: norms, clipping, ignoring (zeroing) gradients and the keep
  rules, as ``torch.nn.utils`` does clipping: measure, then act;
* :mod:`gradlab.step`: :func:`step_if_`, the exact skip of an optimizer step;
* :mod:`gradlab.guard`: :class:`StepGuard`, a loop helper that takes, clips or skips;
* :mod:`gradlab.adaptive`: thresholds that follow the run, and unit-wise clipping;
* :mod:`gradlab.accumulation`: gradient accumulation that leaves out a bad micro-batch;
* :mod:`gradlab.per_sample`: per-sample clipping and ignoring (DP-SGD), ghost norms;
* :mod:`gradlab.distributed`: norms and decisions over process groups and DTensors;
* :mod:`gradlab.flat`: one contiguous gradient buffer, so that every function acts on
  thousands of gradients in one kernel;
* :mod:`gradlab.sync`: what counts as a host read, and a detector for it.

The book's own code is a separate distribution, ``gradlab-book``; nothing here imports it.
"""

from gradlab.accumulation import MicroBatchAccumulator
from gradlab.adaptive import AutoClip, SigmaSkip, ThresholdPolicy, ZClip, agc_
from gradlab.clip import (
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
    grad_ignore_norm_,
    grad_ignore_value_,
    grad_ignore_with_norm_,
    keep_by_norm,
    keep_by_value,
)
from gradlab.flat import FlatGrads, flat_grads_of, flatten_grads
from gradlab.guard import DECISIONS, SkipLimitError, StepGuard, StepRecord
from gradlab.per_sample import (
    GhostClipping,
    clip_per_sample_,
    ignore_per_sample_,
    per_sample_grads,
    per_sample_norms,
)
from gradlab.step import step_if_

__all__ = [
    "DECISIONS",
    "AutoClip",
    "FlatGrads",
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
    "flat_grads_of",
    "flatten_grads",
    "get_total_norm",
    "grad_ignore_norm_",
    "grad_ignore_value_",
    "grad_ignore_with_norm_",
    "ignore_per_sample_",
    "keep_by_norm",
    "keep_by_value",
    "per_sample_grads",
    "per_sample_norms",
    "step_if_",
]

__version__ = "0.3.0.dev0"
