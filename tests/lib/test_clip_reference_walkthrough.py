"""The two tests of the reference walk-through, with the functions' real names.

The originals call ``grad_ignore_norm`` and ``grad_ignore_value`` (names that do not
exist), plant one large row into the gradient of a batch of logits, and check that
the whole gradient is zeroed. Here they are rewritten, and each gets the other half
of its claim: a gradient under the threshold is left exactly as it was.
"""

import torch
from clip_helpers import assert_all_plus_zero, assert_grads_unchanged, math_norm, snapshot

from gradlab import grad_ignore_norm_, grad_ignore_value_

BATCH, ACTIONS = 4, 32


def _logits_with_mse_gradient(seed: int) -> torch.Tensor:
    """A (4, 32) batch of logits whose .grad holds d MSE / d logits."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, ACTIONS, generator=gen).requires_grad_(True)
    targets = torch.randn(BATCH, ACTIONS, generator=gen)
    torch.nn.functional.mse_loss(logits, targets).backward()
    return logits


def test_grad_ignore_norm_():
    logits = _logits_with_mse_gradient(seed=0)
    logits.grad[0] = 0.5  # one row of 32 entries of 0.5: norm >= sqrt(32) / 2 > 0.5
    norm_before = math_norm([logits.grad], 2.0)
    assert norm_before > 0.5

    total = grad_ignore_norm_(logits, 0.5, 2)

    assert isinstance(logits.grad, torch.Tensor)
    assert logits.grad.shape == (BATCH, ACTIONS)
    assert_all_plus_zero([logits])  # every row, not only the planted one
    assert abs(float(total) - norm_before) <= 1e-6 * norm_before  # the norm before


def test_grad_ignore_norm_keeps_a_small_gradient():
    logits = _logits_with_mse_gradient(seed=0)
    before = snapshot([logits])
    total = grad_ignore_norm_(logits, 0.5, 2)
    assert float(total) < 0.5  # the MSE gradient alone is small
    assert_grads_unchanged([logits], before)


def test_grad_ignore_value_():
    clip_value = 0.5
    logits = _logits_with_mse_gradient(seed=1)
    logits.grad[0] = 0.6  # entries above clip_value

    largest = grad_ignore_value_(logits, clip_value)

    assert isinstance(logits.grad, torch.Tensor)
    assert_all_plus_zero([logits])
    assert float(largest) == float(torch.tensor(0.6))  # returned: the max |entry| before


def test_grad_ignore_value_keeps_a_small_gradient():
    logits = _logits_with_mse_gradient(seed=1)
    assert float(logits.grad.abs().max()) < 0.5
    before = snapshot([logits])
    grad_ignore_value_(logits, 0.5)
    assert_grads_unchanged([logits], before)
