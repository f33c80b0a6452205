"""gradlab: clip or ignore exploding gradients, in PyTorch.

The algorithms live in :mod:`gradlab.clip`; the book's figures, demos and exercise
checks are built on them.
"""

from gradlab.clip import (
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
    grad_ignore_norm_,
    grad_ignore_value_,
    grad_ignore_with_norm_,
)
from gradlab.skip import StepGuard, StepRecord

__all__ = [
    "StepGuard",
    "StepRecord",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "get_total_norm",
    "grad_ignore_norm_",
    "grad_ignore_value_",
    "grad_ignore_with_norm_",
]

__version__ = "0.1.0"
