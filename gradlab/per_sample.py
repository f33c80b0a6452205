r"""Per-sample clipping and per-sample ignoring: the clip step of DP-SGD.

Clipping the *batch* gradient bounds the step; clipping each *sample's* gradient
before the sum bounds what any one sample can do to it, which is what differential
privacy needs (Abadi et al. 2016). With per-sample gradients :math:`g_i` (one per
sample :math:`i` of a batch of :math:`B`) and a threshold :math:`C`,

.. math::
    \tilde g = \sum_{i=1}^{B} c_i\, g_i + \sigma C\, \xi, \qquad
    \xi \sim \mathcal N(0, I),

where :math:`c_i` is the clip coefficient (:func:`clip_per_sample_`) or a 0/1 keep
decision (:func:`ignore_per_sample_`), and the optional noise term (``noise_multiplier``
:math:`\sigma`, off by default) is DP-SGD's Gaussian mechanism. Privacy *accounting*
is not part of this module.

Two ways to get there:

* **Given per-sample gradients** (the reference path, for any model):
  :func:`per_sample_grads` computes them with ``torch.func`` (``vmap(grad(...))``) as
  tensors of shape ``(B, *param.shape)``, and :func:`clip_per_sample_` /
  :func:`ignore_per_sample_` reduce them into ``.grad``. Memory: :math:`B` times the
  model's size.
* **Ghost clipping** (:class:`GhostClipping`, for ``nn.Linear`` and ``nn.Embedding``
  layers, plus the small affine parameters of ``nn.LayerNorm`` and ``nn.RMSNorm``):
  the per-sample norms come from each layer's inputs and output gradients,
  without ever forming a per-sample gradient (Goodfellow 2015; Li et al. 2022), and the
  clipped sum is then formed directly from the same tensors ("book-keeping", Bu et al.
  2023), so the whole step costs one forward and one backward pass. Each layer type
  has one rule, registered for its class, as in opacus's registry of norm samplers.

Conventions shared by every function here:

* The coefficient and the keep test are those of :func:`gradlab.clip_grad_norm_` and
  :func:`gradlab.grad_ignore_norm_` applied to one sample at a time, with the same
  :math:`\epsilon = 10^{-6}`:

  .. math::
      c_i = \min\Bigl(1, \frac{C}{\|g_i\|_2 + \epsilon}\Bigr), \qquad
      \text{keep}_i \iff \frac{C}{\|g_i\|_2 + \epsilon} \ge 1 .

  A NaN norm fails every comparison and an infinite one gives ``C / inf = 0``, so
  ignoring drops non-finite samples; the drop is a select (``torch.where``), never a
  multiplication by 0, so a dropped NaN leaves no trace. Clipping, like torch's
  ``clip_grad_norm_``, lets a non-finite sample make the sum non-finite.
* ``max_norm`` is either one number (a *flat* threshold on each sample's norm over all
  parameters) or a sequence with one number per parameter (*per-layer* thresholds:
  each parameter's per-sample gradient is clipped on its own). Per-layer *ignoring*
  drops a sample from every parameter as soon as one of its parameter norms fails its
  threshold: a sample contributes whole or not at all.
* The result is **added** to ``.grad``, as ``loss.backward()`` would add it (call
  ``optimizer.zero_grad()`` as usual). ``reduction="mean"`` divides the noisy sum by
  the batch size :math:`B`.
* Nothing reads a tensor's value on the host (no device-to-host synchronisation).
* Only the 2-norm is offered: it is the one the Gaussian mechanism calibrates to.

References:
    M. Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
    I. Goodfellow, "Efficient Per-Example Gradient Computations", arXiv:1510.01799, 2015.
    X. Li, F. Tramèr, P. Liang, T. Hashimoto, "Large Language Models Can Be Strong
    Differentially Private Learners", ICLR 2022.
    Z. Bu, Y.-X. Wang, S. Zha, G. Karypis, "Differentially Private Optimization on
    Large Model at Small Cost", ICML 2023.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from gradlab._common import EPS, as_tensor_list, check_real, check_threshold

__all__ = [
    "GhostClipping",
    "clip_per_sample_",
    "ignore_per_sample_",
    "per_sample_grads",
    "per_sample_norms",
]

MaxNorm = float | Sequence[float]

# --------------------------------------------------------------------------- checks


def _check_max_norm(max_norm: object, count: int) -> float | list[float]:
    """A float (flat) or a list of ``count`` floats (per-layer), or raise ValueError."""
    if isinstance(max_norm, Tensor):
        raise ValueError(
            "max_norm must be a number or a sequence of numbers, not a tensor "
            "(reading a tensor threshold would synchronise with the device)"
        )
    if isinstance(max_norm, Sequence) and not isinstance(max_norm, str):
        if len(max_norm) != count:
            raise ValueError(
                f"max_norm, as a sequence, must have one threshold per parameter "
                f"({count}), got {len(max_norm)}"
            )
        return [check_threshold(f"max_norm[{k}]", v) for k, v in enumerate(max_norm)]
    return check_threshold("max_norm", max_norm)


def _check_noise(
    noise_multiplier: object, generator: object, max_norm: float | list[float]
) -> tuple[float, float]:
    """``(sigma, sigma * sensitivity)``: the noise multiplier and the noise's std."""
    sigma = check_real("noise_multiplier", noise_multiplier, 0.0)
    if not math.isfinite(sigma):
        raise ValueError(f"noise_multiplier must be finite, got {sigma!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(
            f"generator must be None or a torch.Generator, got {type(generator).__name__}"
        )
    if sigma == 0:
        return 0.0, 0.0
    sensitivity = math.hypot(*max_norm) if isinstance(max_norm, list) else max_norm
    if not math.isfinite(sensitivity):
        raise ValueError("noise_multiplier > 0 needs a finite max_norm (the noise is sigma * C)")
    return sigma, sigma * sensitivity


def _check_reduction(reduction: object) -> None:
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms are accumulated in: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------- shared arithmetic


def _factors(
    sq_norms: list[Tensor], max_norm: float | list[float], mode: str, scale: float
) -> tuple[list[Tensor], Tensor]:
    r"""Per-parameter factors from per-parameter squared per-sample norms (each ``(B,)``).

    ``mode="clip"``: for each parameter, ``scale`` times the ``(B,)`` clip coefficients
    (one shared tensor for a flat threshold). ``mode="ignore"``: for each parameter the
    same ``(B,)`` boolean keep mask (``scale`` is then the caller's to apply). Also
    returns the norms the public functions return: ``(B,)`` or ``(B, P)``.
    """
    sq = torch.stack(sq_norms, dim=1)
    count = sq.shape[1]
    if isinstance(max_norm, list):
        norms = sq.sqrt()
        thresholds = torch.tensor(max_norm, dtype=norms.dtype, device=norms.device)
        ratio = thresholds / (norms + EPS)
        if mode == "clip":
            coef = torch.clamp(ratio, max=1.0)
            if scale != 1.0:
                coef = coef * scale
            return list(coef.unbind(1)), norms
        return [(ratio >= 1.0).all(dim=1)] * count, norms
    norms = sq.sum(dim=1).sqrt()
    ratio = max_norm / (norms + EPS)
    if mode == "clip":
        coef = torch.clamp(ratio, max=1.0)
        if scale != 1.0:
            coef = coef * scale
        return [coef] * count, norms
    return [ratio >= 1.0] * count, norms


def _write(
    param: Tensor, summed: Tensor, noise_std: float, generator: torch.Generator | None
) -> None:
    """Add noise of standard deviation ``noise_std`` and accumulate into ``param.grad``."""
    if noise_std > 0:
        noise = torch.randn(
            summed.shape, generator=generator, dtype=summed.dtype, device=summed.device
        )
        summed = summed.add_(noise, alpha=noise_std)
    summed = summed.to(param.dtype)
    if param.grad is None:
        param.grad = summed
    else:
        param.grad.add_(summed)


def _weigh(t: Tensor, factor: Tensor, scale: float) -> Tensor:
    r"""``t`` (``(B, ...)``) weighted per sample by a clip coefficient or a keep mask.

    Args:
        t (Tensor): a per-sample tensor, batch in dimension 0.
        factor (Tensor): ``(B,)``: float clip coefficients, the reduction's scale already
            in them (a product); or a boolean keep mask (a select, so that a dropped NaN
            leaves no trace, then ``scale``).
        scale (float): the reduction's :math:`1/R`, applied with a keep mask only.

    Returns:
        The weighted tensor, shaped like ``t``.
    """
    shape = (t.shape[0],) + (1,) * (t.dim() - 1)
    if factor.dtype == torch.bool:
        t = torch.where(factor.view(shape), t, 0)
        return t * scale if scale != 1.0 else t
    return t * factor.to(t.dtype).view(shape)


def _keep(t: Tensor, factor: Tensor) -> Tensor:
    """``t`` with the dropped samples zeroed by a select if ``factor`` is a keep mask."""
    if factor.dtype != torch.bool:
        return t
    return torch.where(factor.view((t.shape[0],) + (1,) * (t.dim() - 1)), t, 0)


def _weighted_sum(g: Tensor, factor: Tensor, scale: float) -> Tensor:
    r"""The weighted sum over samples :math:`\sum_i w_i g_i` of ``g`` (``(B, *shape)``).

    ``factor`` and ``scale`` as in :func:`_weigh`; a clip's sum is one matrix-vector
    product, a keep mask's a select and a sum.
    """
    if factor.dtype != torch.bool:
        product: Tensor = torch.tensordot(factor.to(g.dtype), g, dims=1)
        return product
    summed = _weigh(g, factor, 1.0).sum(0)
    return summed.mul_(scale) if scale != 1.0 else summed


# ---------------------------------------------------------------- reference path


def per_sample_norms(grad_samples: Sequence[Tensor]) -> Tensor:
    r"""The 2-norm of each sample's gradient, per parameter: a ``(B, P)`` tensor.

    .. math::
        N_{i,l} = \| g^{(l)}_i \|_2 \quad\text{and}\quad
        \|g_i\|_2 = \bigl\| (N_{i,1}, \dots, N_{i,P}) \bigr\|_2 .

    Args:
        grad_samples (Sequence[Tensor]): ``P`` tensors of shape ``(B, *param.shape)``,
            one batch size :math:`B` for all.

    Returns:
        The ``(B, P)`` norms, in float64 if any of ``grad_samples`` is float64, else
        in float32 (16-bit gradients are accumulated in float32).

    .. note::
        No host read.
    """
    grad_samples = as_tensor_list(grad_samples, "grad_samples")
    if not grad_samples:
        raise ValueError("grad_samples must contain at least one tensor")
    if any(g.dim() == 0 for g in grad_samples):
        raise ValueError("grad_samples must have a leading batch dimension (B, *param.shape)")
    batch = grad_samples[0].shape[0]
    for k, g in enumerate(grad_samples):
        if g.shape[0] != batch:
            raise ValueError(
                f"grad_samples[{k}] has batch size {g.shape[0]}, grad_samples[0] has {batch}"
            )
    acc = _acc_dtype(max((g.dtype for g in grad_samples), key=lambda d: d == torch.float64))
    norms = [
        torch.linalg.vector_norm(g.reshape(batch, -1), 2, dim=1, dtype=acc) for g in grad_samples
    ]
    return torch.stack(norms, dim=1)


def _check_pairs(
    parameters: Iterable[Tensor], grad_samples: Sequence[Tensor]
) -> tuple[list[Tensor], list[Tensor]]:
    params = as_tensor_list(parameters, "parameters")
    samples = as_tensor_list(grad_samples, "grad_samples")
    if len(params) != len(samples):
        raise ValueError(
            f"parameters and grad_samples must pair up, got {len(params)} parameters and "
            f"{len(samples)} grad_samples"
        )
    if not params:
        raise ValueError("parameters must contain at least one tensor")
    for k, (p, g) in enumerate(zip(params, samples, strict=True)):
        if g.dim() != p.dim() + 1 or g.shape[1:] != p.shape:
            raise ValueError(
                f"grad_samples[{k}] must have shape (B, *{tuple(p.shape)}), got {tuple(g.shape)}"
            )
        if g.shape[0] == 0:
            raise ValueError(f"grad_samples[{k}] has an empty batch")
    return params, samples


def _reduce_per_sample(
    parameters: Iterable[Tensor],
    grad_samples: Sequence[Tensor],
    max_norm: MaxNorm,
    noise_multiplier: float,
    generator: torch.Generator | None,
    reduction: str,
    mode: str,
) -> Tensor:
    params, samples = _check_pairs(parameters, grad_samples)
    checked = _check_max_norm(max_norm, len(params))
    _, noise_std = _check_noise(noise_multiplier, generator, checked)
    _check_reduction(reduction)
    scale = 1.0 / samples[0].shape[0] if reduction == "mean" else 1.0
    with torch.no_grad():
        sq = [n.square() for n in per_sample_norms(samples).unbind(1)]
        factors, norms = _factors(sq, checked, mode, scale)
        for p, g, f in zip(params, samples, factors, strict=True):
            _write(p, _weighted_sum(g, f, scale), noise_std * scale, generator)
    return norms


def clip_per_sample_(
    parameters: Iterable[Tensor],
    grad_samples: Sequence[Tensor],
    max_norm: MaxNorm,
    *,
    noise_multiplier: float = 0.0,
    generator: torch.Generator | None = None,
    reduction: str = "sum",
) -> Tensor:
    r"""Clip each sample's gradient to ``max_norm``, sum, and add the result to ``.grad``.

    .. math::
        c_i = \min\Bigl(1, \frac{C}{\|g_i\|_2 + 10^{-6}}\Bigr), \qquad
        p.\mathrm{grad} \mathrel{+}= \frac{1}{R}\Bigl(\sum_{i=1}^{B} c_i g_i
        + \sigma C \xi\Bigr),

    with :math:`R = 1` (``reduction="sum"``) or :math:`B` (``"mean"``). With per-layer
    thresholds :math:`C_l`, each parameter :math:`l` uses its own norm and threshold,
    and the noise scale is :math:`\sigma \|(C_1, \dots, C_P)\|_2`, the sensitivity of
    the whole update (Abadi et al. 2016, the clip step of DP-SGD).

    Args:
        parameters (Iterable[Tensor]): the ``P`` tensors that receive the clipped sum
            in ``.grad`` (added to it; created if None).
        grad_samples (Sequence[Tensor]): ``P`` tensors of shape ``(B, *param.shape)``,
            in the order of ``parameters``: for instance the output of
            :func:`per_sample_grads`.
        max_norm (float or Sequence[float]): :math:`C`, a non-negative number (flat),
            or ``P`` numbers, one per parameter (per-layer); ``inf`` allowed.
        noise_multiplier (float): :math:`\sigma`, finite and >= 0; 0 adds no noise.
            Default: 0.0
        generator (torch.Generator, optional): the random generator for the noise
            (seeded runs). Default: None
        reduction (str): ``"sum"`` or ``"mean"`` (divide by :math:`B`). Default: ``"sum"``

    Returns:
        The per-sample norms before clipping: ``(B,)`` (flat) or ``(B, P)``
        (per-layer).

    .. note::
        No host read.
    """
    return _reduce_per_sample(
        parameters, grad_samples, max_norm, noise_multiplier, generator, reduction, "clip"
    )


def ignore_per_sample_(
    parameters: Iterable[Tensor],
    grad_samples: Sequence[Tensor],
    max_norm: MaxNorm,
    *,
    noise_multiplier: float = 0.0,
    generator: torch.Generator | None = None,
    reduction: str = "sum",
) -> Tensor:
    r"""Sum only the samples whose gradient norm is finite and within ``max_norm``.

    .. math::
        \text{keep}_i \iff \frac{C}{\|g_i\|_2 + 10^{-6}} \ge 1, \qquad
        p.\mathrm{grad} \mathrel{+}= \frac{1}{R}\Bigl(\sum_{i:\,\text{keep}_i} g_i
        + \sigma C \xi\Bigr).

    A dropped sample is removed by a select, so a NaN or an infinity in it never
    reaches the sum; the kept samples are summed exactly as if the dropped ones had
    not been in the batch (:math:`R = B` still counts them with ``"mean"``). With
    per-layer thresholds a sample is kept only if *every* parameter passes its own
    threshold.

    Args:
        parameters (Iterable[Tensor]): the ``P`` tensors that receive the sum in
            ``.grad`` (added to it; created if None).
        grad_samples (Sequence[Tensor]): ``P`` tensors of shape ``(B, *param.shape)``,
            in the order of ``parameters``.
        max_norm (float or Sequence[float]): :math:`C`, a non-negative number (flat),
            or ``P`` numbers, one per parameter (per-layer); ``inf`` allowed.
        noise_multiplier (float): :math:`\sigma`, finite and >= 0. Default: 0.0
        generator (torch.Generator, optional): the random generator for the noise.
            Default: None
        reduction (str): ``"sum"`` or ``"mean"`` (divide by :math:`B`). Default: ``"sum"``

    Returns:
        The per-sample norms: ``(B,)`` (flat) or ``(B, P)`` (per-layer).

    .. note::
        No host read.
    """
    return _reduce_per_sample(
        parameters, grad_samples, max_norm, noise_multiplier, generator, reduction, "ignore"
    )


def per_sample_grads(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    inputs: Tensor,
    *targets: Tensor,
    chunk_size: int | None = None,
    randomness: str = "error",
) -> list[Tensor]:
    r"""Per-sample gradients of every trainable parameter, with ``torch.func``.

    .. math::
        g_i = \nabla_\theta\, \ell\bigl(f_\theta(x_i), y_i\bigr), \quad i = 1, \dots, B,

    computed as ``vmap(grad(loss_of_one_sample))``: each sample runs through the model
    as a batch of one, so the model must treat samples independently (no batch
    statistics: BatchNorm in training mode does not qualify). Works for any model
    ``torch.func`` can trace; the reference for :class:`GhostClipping`.

    Args:
        model (nn.Module): the model; its trainable parameters (``requires_grad``) are
            differentiated, in ``model.parameters()`` order.
        loss_fn (Callable[..., Tensor]): ``loss_fn(model(x), *y)`` for a batch of one, a
            scalar or a one-element tensor (it is summed), e.g.
            ``nn.functional.cross_entropy``.
        inputs (Tensor): the batch, ``(B, ...)``.
        targets (Tensor): further per-sample tensors ``(B, ...)`` passed on to
            ``loss_fn``.
        chunk_size (int, optional): passed to :func:`torch.func.vmap` to bound memory.
            Default: None
        randomness (str): passed to :func:`torch.func.vmap` (``"different"`` for
            dropout). Default: ``"error"``

    Returns:
        A list of tensors of shape ``(B, *param.shape)``, one per trainable parameter.

    .. note::
        No host read of its own; the model's forward may have some.
    """
    from torch.func import functional_call, grad, vmap

    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    for name, t in [("inputs", inputs), *((f"targets[{k}]", t) for k, t in enumerate(targets))]:
        if not isinstance(t, Tensor) or t.dim() == 0:
            raise ValueError(f"{name} must be a tensor with a batch dimension")
        if t.shape[0] != inputs.shape[0]:
            raise ValueError(f"{name} has batch size {t.shape[0]}, inputs has {inputs.shape[0]}")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if not names:
        raise ValueError("model has no trainable parameters")
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def loss_of_one(params: dict[str, Tensor], x: Tensor, *y: Tensor) -> Tensor:
        out = functional_call(model, params, (x.unsqueeze(0),))
        return loss_fn(out, *(t.unsqueeze(0) for t in y)).sum()

    in_dims = (None, 0) + (0,) * len(targets)
    grads = vmap(grad(loss_of_one), in_dims=in_dims, chunk_size=chunk_size, randomness=randomness)(
        params, inputs, *targets
    )
    return [grads[n] for n in names]


# ---------------------------------------------------------------- ghost clipping

#: A layer's recorded calls that reached the loss: (input, output gradient) pairs, the
#: input detached, both with the batch in dimension 0.
Calls = list[tuple[Tensor, Tensor]]


class _LayerGrads(NamedTuple):
    r"""What a layer rule returns: its parameters' per-sample norms, and their clipped sum.

    Attributes:
        sq_norms (list[Tensor]): for each parameter name the rule was given, in that
            order, the ``(B,)`` squared per-sample gradient norms
            :math:`\|\nabla \ell_i\|^2`, in float32 or float64.
        sums (Callable[[list[Tensor], float], list[Tensor]]): ``sums(factors, scale)``,
            with one ``(B,)`` factor per parameter name (see :func:`_weigh`) and the
            reduction's scale, gives each parameter's :math:`\sum_i w_i \nabla \ell_i`,
            shaped like the parameter.
    """

    sq_norms: list[Tensor]
    sums: Callable[[list[Tensor], float], list[Tensor]]


#: ``rule(module, calls, names, batch)``: the per-layer function of the registry; its
#: ``module`` is an instance of the class it is registered for.
Rule = Callable[[Any, Calls, tuple[str, ...], int], _LayerGrads]


class _Registration(NamedTuple):
    rule: Rule
    params: tuple[str, ...]  # the parameter names the rule handles, in registration order
    min_dims: Callable[[Any], int]  # the fewest dimensions of a batched input
    check: Callable[[Any], str | None]  # why an instance is refused, or None


#: The layer types :class:`GhostClipping` supports, each with its rule (opacus keeps the
#: same kind of registry: ``register_norm_sampler`` in ``opacus/grad_sample/utils.py``).
_RULES: dict[type[nn.Module], _Registration] = {}


def _accept(module: nn.Module) -> str | None:
    return None


def _register(
    layer: type[nn.Module],
    *,
    params: tuple[str, ...],
    min_dims: Callable[[Any], int],
    check: Callable[[Any], str | None] = _accept,
) -> Callable[[Rule], Rule]:
    """Register the decorated function as the ghost rule of ``layer``.

    Args:
        layer (type[nn.Module]): the module class. Its subclasses use the rule too,
            unless they replace ``forward``.
        params (tuple[str, ...]): the names of the parameters the rule handles; a
            module with another trainable parameter is refused.
        min_dims (Callable[[nn.Module], int]): the fewest dimensions of a batched input
            of a module (checked before the backward pass).
        check (Callable[[nn.Module], str | None]): returns why a module (a
            configuration the rule does not handle) is refused, or None. Default: accept

    Returns:
        The decorator, which returns the rule unchanged.
    """

    def decorate(rule: Rule) -> Rule:
        _RULES[layer] = _Registration(rule, params, min_dims, check)
        return rule

    return decorate


def _cat(parts: list[Tensor]) -> Tensor:
    """A layer's calls side by side along the sequence dimension (1), as autograd sums them."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _formed(grads: list[Tensor]) -> _LayerGrads:
    """A rule's result from per-sample gradients formed outright, each ``(B, *shape)``."""
    batch = grads[0].shape[0]
    sq_norms = [
        torch.linalg.vector_norm(g.reshape(batch, -1), 2, dim=1, dtype=_acc_dtype(g.dtype)).square()
        for g in grads
    ]

    def sums(factors: list[Tensor], scale: float) -> list[Tensor]:
        return [_weighted_sum(g, f, scale) for g, f in zip(grads, factors, strict=True)]

    return _LayerGrads(sq_norms, sums)


def _linear_sq_norms(
    a: Tensor, b: Tensor, weight: bool, bias: bool
) -> tuple[list[Tensor], Tensor | None]:
    r"""Per-sample squared norms of a Linear layer's weight and bias gradients.

    The weight's per-sample gradient is :math:`G_i = \sum_t b_{it} a_{it}^\top =
    b_i^\top a_i`, so (Li et al. 2022, the "ghost norm")

    .. math::
        \|G_i\|_F^2 = \langle a_i a_i^\top, b_i b_i^\top \rangle_F
        = \sum_{t, s} (a_{it} \cdot a_{is})(b_{it} \cdot b_{is})
        \;(\text{cost } T^2(d_\text{in} + d_\text{out})), \qquad
        \|G_i\|_F^2 = \|a_i\|^2 \|b_i\|^2 \;(T = 1),

    and when :math:`T^2 > d_\text{in} d_\text{out}` it is cheaper to form :math:`G_i`
    (the Gram matrices would be larger than :math:`G_i`). The bias's per-sample
    gradient is :math:`\sum_t b_{it}`.

    The Gram form is a sum of terms of both signs: when a sample's rows nearly cancel
    it can round below zero, and its square root would be NaN for a finite sample. It
    is clamped at 0, which keeps a NaN a NaN (``torch.clamp`` propagates NaN).

    Args:
        a (Tensor): the inputs, ``(B, T, d_in)``.
        b (Tensor): the output gradients, ``(B, T, d_out)``, the dtype of ``a``.
        weight (bool): return the weight's norms.
        bias (bool): return the bias's norms (after the weight's).

    Returns:
        A list of ``(B,)`` tensors, the weight's, then the bias's, as asked; and the
        per-sample weight gradients ``(B, d_out, d_in)`` if they were formed, else None.
    """
    out = []
    formed = None
    seq, d_in, d_out = a.shape[1], a.shape[2], b.shape[2]
    if weight:
        if seq == 1:
            out.append(a.square().sum((1, 2)) * b.square().sum((1, 2)))
        elif seq * seq <= d_in * d_out:
            aa = torch.bmm(a, a.transpose(1, 2))
            bb = torch.bmm(b, b.transpose(1, 2))
            out.append((aa * bb).sum((1, 2)).clamp_(min=0))
        else:
            formed = torch.bmm(b.transpose(1, 2), a)
            out.append(formed.square().sum((1, 2)))
    if bias:
        out.append(b.sum(1).square().sum(1))
    return out, formed


def _embedding_sq_norm(ids: Tensor, b: Tensor) -> Tensor:
    r"""Per-sample squared norm of an Embedding's weight gradient.

    Row :math:`v` of sample :math:`i`'s gradient is :math:`\sum_{t: \text{id}_{it} = v}
    b_{it}`, so

    .. math::
        \|G_i\|_F^2 = \sum_v \Bigl\|\sum_{t: \text{id}_{it} = v} b_{it}\Bigr\|^2 .

    The rows of one id are summed in place of the Gram form
    :math:`\sum_{t, s} [\text{id}_{it} = \text{id}_{is}] \langle b_{it}, b_{is}
    \rangle` (Li et al. 2022): its cost is :math:`T d` per sample instead of
    :math:`T^2 d`, and a sum of squares cannot round below zero, where the Gram form
    does when repeated ids' rows nearly cancel. Each sample's ids are sorted, and equal
    ids, now adjacent, are numbered by a cumulative sum, and each row is added to its
    id's (no host read).

    Args:
        ids (Tensor): the ids, ``(B, T)``.
        b (Tensor): the output gradients, ``(B, T, d)``, padding positions zeroed.

    Returns:
        The ``(B,)`` squared norms.
    """
    batch, seq, d = b.shape
    if seq > 1:
        ids, order = ids.sort(dim=1)
        first = torch.ones_like(ids[:, :1], dtype=torch.bool)
        group = torch.cat([first, ids[:, 1:] != ids[:, :-1]], 1).cumsum(1) - 1
        # token t of sample i goes to row i * T + (its id's number in sample i)
        slot = torch.empty_like(group).scatter_(1, order, group)
        slot += torch.arange(batch, device=slot.device).unsqueeze(1) * seq
        rows = b.new_zeros(batch * seq, d).index_add_(0, slot.reshape(-1), b.reshape(-1, d))
        b = rows.view(batch, seq, d)
    return b.square().sum((1, 2))


@_register(nn.Linear, params=("weight", "bias"), min_dims=lambda m: 2)
def _linear(module: nn.Linear, calls: Calls, names: tuple[str, ...], batch: int) -> _LayerGrads:
    r"""``nn.Linear``: ghost norms, and the book-keeping sum :math:`(w \odot b)^\top a`.

    Every dimension of the input between the batch and the features is a sequence
    dimension :math:`T`; the calls of the layer are concatenated along it. Where the
    norms formed the per-sample weight gradients :math:`G_i` (long sequences), the sum
    is :math:`\sum_i w_i G_i` instead, which saves a product as large as the backward's.
    """
    d_in, d_out = module.in_features, module.out_features
    a = _cat([x.reshape(batch, -1, d_in) for x, _ in calls])
    b = _cat([g.reshape(batch, -1, d_out) for _, g in calls])
    if a.dtype != b.dtype:  # autocast: the layer ran in lower precision
        common = torch.promote_types(a.dtype, b.dtype)
        a, b = a.to(common), b.to(common)
    acc = _acc_dtype(b.dtype)
    sq_norms, formed = _linear_sq_norms(a.to(acc), b.to(acc), "weight" in names, "bias" in names)

    def sums(factors: list[Tensor], scale: float) -> list[Tensor]:
        out, last, bw = [], None, b
        for name, f in zip(names, factors, strict=True):
            if name == "weight" and formed is not None:
                out.append(_weighted_sum(formed, f, scale))
                continue
            if f is not last:  # weight and bias share a flat threshold's coefficient
                bw, last = _weigh(b, f, scale), f
            if name == "weight":  # a dropped sample's NaN input must not reach the product
                out.append(bw.reshape(-1, d_out).T @ _keep(a, f).reshape(-1, d_in))
            else:
                out.append(bw.sum((0, 1)))
        return out

    return _LayerGrads(sq_norms, sums)


def _embedding_check(module: nn.Embedding) -> str | None:
    if module.scale_grad_by_freq or module.sparse:
        return "GhostClipping does not support nn.Embedding with scale_grad_by_freq or sparse"
    return None


@_register(nn.Embedding, params=("weight",), min_dims=lambda m: 1, check=_embedding_check)
def _embedding(
    module: nn.Embedding, calls: Calls, names: tuple[str, ...], batch: int
) -> _LayerGrads:
    """``nn.Embedding``: ghost norms over repeated ids, and an ``index_add_`` sum.

    The ids are ``(B, ...)``; ``padding_idx`` positions get no gradient, as in torch.
    """
    d = module.embedding_dim
    ids = _cat([x.reshape(batch, -1) for x, _ in calls])
    b = _cat([g.reshape(batch, -1, d) for _, g in calls])
    if module.padding_idx is not None:
        b = torch.where((ids == module.padding_idx).unsqueeze(-1), 0, b)
    sq_norms = [_embedding_sq_norm(ids, b.to(_acc_dtype(b.dtype)))]

    def sums(factors: list[Tensor], scale: float) -> list[Tensor]:
        bw = _weigh(b, factors[0], scale)  # ids are integers: nothing to drop there
        grad = bw.new_zeros(module.num_embeddings, d)
        return [grad.index_add_(0, ids.reshape(-1), bw.reshape(-1, d))]

    return _LayerGrads(sq_norms, sums)


def _affine_grads(
    module: nn.LayerNorm | nn.RMSNorm,
    calls: Calls,
    names: tuple[str, ...],
    batch: int,
    normalise: Callable[[Tensor], Tensor],
) -> list[Tensor]:
    r"""Per-sample gradients of a normalisation layer's affine parameters, ``(B, *shape)``.

    With :math:`\hat x` the normalised input (recomputed by ``normalise``),
    :math:`\nabla_\gamma \ell_i = \sum_t b_{it} \odot \hat x_{it}` and
    :math:`\nabla_\beta \ell_i = \sum_t b_{it}`, summed over the calls. They are as
    small as the parameters, so they are formed outright.

    Args:
        module (nn.Module): the layer, with ``normalized_shape``.
        calls (Calls): its (input, output gradient) pairs.
        names (tuple[str, ...]): ``"weight"`` (:math:`\gamma`) and/or ``"bias"``
            (:math:`\beta`), the order of the result.
        batch (int): :math:`B`.
        normalise (Callable[[Tensor], Tensor]): the layer's normalisation, no affine.

    Returns:
        One tensor per name.
    """
    shape = tuple(module.normalized_shape)
    total: list[Tensor] = []
    for x, b in calls:
        dtype = torch.promote_types(x.dtype, b.dtype)
        x, b = x.to(dtype), b.to(dtype)
        b = b.reshape(batch, -1, *shape)
        grads = {"bias": b.sum(1)}
        if "weight" in names:
            grads["weight"] = (b * normalise(x).reshape(batch, -1, *shape)).sum(1)
        call = [grads[n] for n in names]
        total = [g + h for g, h in zip(total, call, strict=True)] if total else call
    return total


def _norm_dims(module: nn.LayerNorm | nn.RMSNorm) -> int:
    return len(module.normalized_shape) + 1


@_register(nn.LayerNorm, params=("weight", "bias"), min_dims=_norm_dims)
def _layer_norm(
    module: nn.LayerNorm, calls: Calls, names: tuple[str, ...], batch: int
) -> _LayerGrads:
    """``nn.LayerNorm``'s affine parameters, per-sample gradients formed outright."""
    shape = tuple(module.normalized_shape)

    def normalise(x: Tensor) -> Tensor:
        return nn.functional.layer_norm(x, shape, None, None, module.eps)

    return _formed(_affine_grads(module, calls, names, batch, normalise))


@_register(nn.RMSNorm, params=("weight",), min_dims=_norm_dims)
def _rms_norm(module: nn.RMSNorm, calls: Calls, names: tuple[str, ...], batch: int) -> _LayerGrads:
    """``nn.RMSNorm``'s weight, per-sample gradients formed outright."""
    shape = tuple(module.normalized_shape)

    def normalise(x: Tensor) -> Tensor:
        return nn.functional.rms_norm(x, shape, None, module.eps)

    return _formed(_affine_grads(module, calls, names, batch, normalise))


def _registration(module: nn.Module, label: str, names: set[str]) -> _Registration:
    """The registered rule for ``module``, or a ValueError that names it and says why.

    Args:
        module (nn.Module): a module with trainable parameters of its own.
        label (str): its name in the model, for the messages.
        names (set[str]): the names of its trainable parameters.

    Returns:
        The registration of the nearest registered class in ``module``'s MRO.
    """
    base = next((cls for cls in type(module).__mro__ if cls in _RULES), None)
    kind = type(module).__name__
    if base is None:
        supported = ", ".join(f"nn.{cls.__name__}" for cls in _RULES)
        raise ValueError(
            f"GhostClipping supports {supported} only; module {label!r} ({kind}) has "
            f"trainable parameters {sorted(names)}: freeze them or use per_sample_grads()"
        )
    if "forward" in vars(module) or type(module).forward is not base.forward:
        raise ValueError(
            f"module {label!r} ({kind}) replaces the forward of nn.{base.__name__}; "
            f"GhostClipping's rule for nn.{base.__name__} assumes nn.{base.__name__}.forward "
            "and would give wrong per-sample norms: freeze its parameters or use "
            "per_sample_grads()"
        )
    registration = _RULES[base]
    if not names <= set(registration.params):
        raise ValueError(
            f"module {label!r} ({kind}) has trainable parameters {sorted(names)}, "
            f"GhostClipping handles {list(registration.params)}: freeze the others or use "
            "per_sample_grads()"
        )
    reason = registration.check(module)
    if reason is not None:
        raise ValueError(f"{reason} (module {label!r})")
    return registration


class _Record(NamedTuple):
    """One recorded call of a supported layer."""

    module: nn.Module
    input: Tensor  # detached: the rules read its values only
    output: Tensor
    input_node: Node | None  # the input's autograd node: where the layer's own graph ends
    versions: tuple[int, int]  # the input's and output's versions at the call


def _accumulate_grad_type() -> type:
    """The class of the autograd node that writes a leaf's ``.grad`` (``.variable``)."""
    view = torch.empty(0, requires_grad=True).view(0)
    assert view.grad_fn is not None  # a view of a leaf that requires grad has one
    return type(view.grad_fn.next_functions[0][0])


_ACCUMULATE_GRAD = _accumulate_grad_type()


class GhostClipping:
    r"""Per-sample clipping (or ignoring) in one forward and one backward pass.

    Inside the ``with`` block, forward hooks record each supported layer's input
    :math:`a` and output. :meth:`clip_` then takes the gradient of
    :math:`\sum_i \ell_i` with respect to the recorded *outputs* only (a backward pass
    that skips every weight gradient), giving the output gradients :math:`b`. Since
    :math:`\ell_i` depends on sample :math:`i` alone, :math:`b_i` is sample
    :math:`i`'s own, and for a Linear layer (Goodfellow 2015; Li et al. 2022)

    .. math::
        \|\nabla_W \ell_i\|_F^2 = \langle a_i a_i^\top, b_i b_i^\top \rangle_F
        \overset{T=1}{=} \|a_i\|^2 \|b_i\|^2, \qquad
        \|\nabla_{\text{bias}}\, \ell_i\|^2 = \Bigl\|\sum_t b_{it}\Bigr\|^2 .

    The clipped sum is then formed directly, :math:`\sum_i c_i \nabla_W \ell_i =
    (c \odot b)^\top a` (book-keeping, Bu et al. 2023), and added to ``.grad``: no
    per-sample gradient is ever stored and no second backward is needed. Same
    coefficients, keep test, thresholds, noise and reduction as
    :func:`clip_per_sample_` / :func:`ignore_per_sample_`.

    Each supported layer type has one rule, a function registered for its class (as
    opacus registers a norm sampler per layer type), which turns the layer's recorded
    calls into its per-sample norms and its weighted sum.

    Example::

        ghost = GhostClipping(model)
        for x, y in loader:
            optimizer.zero_grad()
            with ghost:
                losses = F.cross_entropy(model(x), y, reduction="none")  # (B,)
                ghost.clip_(losses, max_norm=1.0, reduction="mean")
            optimizer.step()

    Contract:

    * Supported layers: ``nn.Linear`` (input ``(B, ..., d_in)``: every dimension
      between the batch and the features is a sequence dimension :math:`T`) and
      ``nn.Embedding`` (ids ``(B, ...)``; ``padding_idx`` honoured; not
      ``scale_grad_by_freq`` or ``sparse``), by ghost norms; ``nn.LayerNorm`` and
      ``nn.RMSNorm`` (affine parameters), whose per-sample gradients are as small as
      the parameters and are formed outright. Dimension 0 is the batch. A subclass
      is supported if it keeps its base's ``forward``; one that replaces it (or an
      instance whose ``forward`` is replaced) is refused with a ValueError naming it.
    * Every trainable parameter must belong to a supported layer; a model with any
      other module holding trainable parameters is refused with a ValueError naming
      it (freeze it, or use :func:`per_sample_grads`). A parameter shared by two
      modules is refused too. The trainable set is read when the object is made.
    * Parameters must act only through their layer's ``forward``: a weight used
      anywhere else in the loss's graph (``F.linear(h, emb.weight)``, a weight read
      by another module, a penalty on the weights in the loss) would get a wrong
      gradient, so :meth:`clip_` and :meth:`ignore_` walk the graph first and refuse
      it with a ValueError naming the parameter. A layer may be called several times
      per forward (its calls are summed, as autograd would).
    * A layer's input and output must not be modified in place after its forward
      (``nn.ReLU(inplace=True)`` right after a Linear is refused with a RuntimeError).
    * Activation checkpointing: ``torch.utils.checkpoint(..., use_reentrant=False)``
      is supported (the layers' recomputation during the backward is not recorded),
      but saves less memory than usual, since the recorded inputs and outputs of the
      supported layers are held until the step. ``use_reentrant=True`` hides its
      layers from autograd's graph and is refused with a ValueError.
    * The loss must be per sample (``reduction="none"``) and samples independent (no
      batch statistics).
    * Forward passes under ``torch.no_grad()`` are not recorded. The recordings are
      dropped by every :meth:`clip_` / :meth:`ignore_` that gets past its checks,
      and on leaving the block: one step per forward pass.

    Args:
        model (nn.Module): the model whose trainable parameters are clipped.

    .. note::
        No host read, in the hooks or in :meth:`clip_` / :meth:`ignore_`.
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self._layers: list[nn.Module] = []
        self._layer_params: list[tuple[str, ...]] = []
        self._rules: list[Rule] = []
        self._min_dims: dict[nn.Module, int] = {}
        self._labels: dict[nn.Module, str] = {}
        self._owners: dict[int, tuple[nn.Module, str]] = {}  # id(param) -> (layer, its name)
        for name, module in model.named_modules(remove_duplicate=True):
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            label = name or "<root>"
            for n, p in own:
                if id(p) in self._owners:
                    raise ValueError(
                        f"parameter {label}.{n} is shared with {self._owners[id(p)][1]}; "
                        "GhostClipping needs each parameter in one layer (use "
                        "per_sample_grads())"
                    )
                self._owners[id(p)] = (module, f"{label}.{n}")
            names = {n for n, _ in own}
            registration = _registration(module, label, names)
            self._layers.append(module)
            self._layer_params.append(tuple(n for n in registration.params if n in names))
            self._rules.append(registration.rule)
            self._min_dims[module] = registration.min_dims(module)
            self._labels[module] = label
        if not self._layers:
            raise ValueError("model has no trainable parameters")
        self._records: list[_Record] = []
        self._handles: list[RemovableHandle] = []
        self._backward = False  # our own backward is running (checkpoints recompute)

    @property
    def parameters(self) -> list[Tensor]:
        """The trainable parameters, in the order per-layer thresholds refer to.

        Returns:
            The parameters, layer by layer, each layer's weight before its bias.
        """
        return [
            getattr(m, n)
            for m, names in zip(self._layers, self._layer_params, strict=True)
            for n in names
        ]

    # ------------------------------------------------------------------ hooks

    def _hook(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        # A call during our own backward is torch.utils.checkpoint recomputing a
        # forward already recorded.
        if self._backward or not torch.is_grad_enabled():
            return
        if isinstance(output, Tensor) and output.requires_grad:
            x = args[0] if args else next(iter(kwargs.values()))  # each layer has one input
            self._records.append(
                _Record(module, x.detach(), output, x.grad_fn, (x._version, output._version))
            )

    def __enter__(self) -> GhostClipping:
        if self._handles:
            raise RuntimeError("GhostClipping is already active")
        self._records.clear()
        self._handles = [
            m.register_forward_hook(self._hook, with_kwargs=True) for m in self._layers
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._records.clear()

    # ---------------------------------------------------------------- the step

    def clip_(
        self,
        loss_per_sample: Tensor,
        max_norm: MaxNorm,
        *,
        noise_multiplier: float = 0.0,
        generator: torch.Generator | None = None,
        reduction: str = "sum",
    ) -> Tensor:
        r"""Add :math:`\frac1R(\sum_i c_i g_i + \sigma C \xi)` to every parameter's ``.grad``.

        Args:
            loss_per_sample (Tensor): the ``(B,)`` losses of the batch just run forward
                inside the block (``reduction="none"``).
            max_norm (float or Sequence[float]): :math:`C`, flat, or one threshold per
                parameter of :attr:`parameters` (per-layer).
            noise_multiplier (float): :math:`\sigma`. Default: 0.0
            generator (torch.Generator, optional): for the noise. Default: None
            reduction (str): ``"sum"`` or ``"mean"``. Default: ``"sum"``

        Returns:
            The per-sample norms before clipping, ``(B,)`` or ``(B, P)``.

        Raises:
            ValueError: a bad argument, an input without the batch dimension, a
                parameter used outside its layer's forward, or a reentrant checkpoint;
                nothing has changed then.
            RuntimeError: outside the block, no recorded forward, or a layer's input or
                output modified in place.

        .. note::
            No host read.
        """
        return self._step(loss_per_sample, max_norm, noise_multiplier, generator, reduction, "clip")

    def ignore_(
        self,
        loss_per_sample: Tensor,
        max_norm: MaxNorm,
        *,
        noise_multiplier: float = 0.0,
        generator: torch.Generator | None = None,
        reduction: str = "sum",
    ) -> Tensor:
        r"""Add the sum of the kept samples' gradients to ``.grad``.

        The keep test is :func:`ignore_per_sample_`'s; dropped samples are removed from
        :math:`a` and :math:`b` by a select before the sum, so their NaNs never reach
        ``.grad``.

        Args:
            loss_per_sample (Tensor): the ``(B,)`` losses of the batch just run forward
                inside the block (``reduction="none"``).
            max_norm (float or Sequence[float]): :math:`C`, flat, or one threshold per
                parameter of :attr:`parameters` (per-layer: a sample is kept only if
                every parameter passes).
            noise_multiplier (float): :math:`\sigma`. Default: 0.0
            generator (torch.Generator, optional): for the noise. Default: None
            reduction (str): ``"sum"`` or ``"mean"``. Default: ``"sum"``

        Returns:
            The per-sample norms, ``(B,)`` or ``(B, P)``.

        Raises:
            ValueError, RuntimeError: as :meth:`clip_`.

        .. note::
            No host read.
        """
        return self._step(
            loss_per_sample, max_norm, noise_multiplier, generator, reduction, "ignore"
        )

    def _step(
        self,
        loss: Tensor,
        max_norm: MaxNorm,
        noise_multiplier: float,
        generator: torch.Generator | None,
        reduction: str,
        mode: str,
    ) -> Tensor:
        if not self._handles:
            raise RuntimeError("call clip_/ignore_ inside `with GhostClipping(model):`")
        if not isinstance(loss, Tensor) or loss.dim() != 1 or loss.shape[0] == 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"loss_per_sample must be a 1-D tensor with one loss per sample "
                f"(reduction='none'), got {shape}"
            )
        if not loss.requires_grad:
            raise ValueError("loss_per_sample does not require grad")
        checked = _check_max_norm(max_norm, len(self.parameters))
        _, noise_std = _check_noise(noise_multiplier, generator, checked)
        _check_reduction(reduction)
        if not self._records:
            raise RuntimeError(
                "no forward pass of a supported layer was recorded: run the model inside the "
                "`with` block, with gradients enabled"
            )
        batch = loss.shape[0]
        for r in self._records:
            kind = type(r.module).__name__
            if (r.input._version, r.output._version) != r.versions:
                raise RuntimeError(
                    f"the input or output of a {kind} layer was modified in place after its "
                    "forward (e.g. by nn.ReLU(inplace=True)); ghost clipping needs both as the "
                    "layer saw them: use out-of-place ops"
                )
            if r.input.dim() < self._min_dims[r.module] or r.input.shape[0] != batch:
                raise ValueError(
                    f"{kind} input of shape {tuple(r.input.shape)} does not start "
                    f"with the batch dimension of loss_per_sample ({batch})"
                )
        self._check_graph(loss)
        records, self._records = self._records, []
        return self._apply(loss, records, checked, noise_std, generator, reduction, mode)

    def _check_graph(self, loss: Tensor) -> None:
        """Refuse a parameter used outside its layer's calls, and reentrant checkpoints.

        Each recorded call owns the autograd nodes between its output and its input;
        every edge of the loss's graph into a parameter (its ``AccumulateGrad`` node) or
        into a call's inner node must then come from a node of a call of that
        parameter's layer. Edges into a call's output are the layer's uses, and free.
        A weight cast once and cached by autocast is an inner node of every call that
        uses it, so a use of that cast elsewhere is seen too. Python work over the
        graph's nodes, no tensor op.
        """
        inner: dict[Node, nn.Module] = {}
        outputs: set[Node] = set()
        for r in self._records:
            root = r.output.grad_fn
            if root is None:
                continue
            outputs.add(root)
            stack = [root]
            while stack:
                node = stack.pop()
                if node in inner or type(node) is _ACCUMULATE_GRAD:
                    continue
                inner[node] = r.module
                for child, _ in node.next_functions:
                    # the input's node is the caller's; a leaf's node has no edges
                    if child is not None and child is not r.input_node:
                        stack.append(child)
        stack = [] if loss.grad_fn is None else [loss.grad_fn]  # None: a leaf loss
        seen = set(stack)
        while stack:
            node = stack.pop()
            if type(node).__name__ == "CheckpointFunctionBackward":
                raise ValueError(
                    "the loss goes through torch.utils.checkpoint with use_reentrant=True, "
                    "which runs its layers without autograd recording them and would write "
                    "their unclipped gradients into .grad in the backward: GhostClipping "
                    "cannot clip them. Use use_reentrant=False, which it supports"
                )
            here = inner.get(node)
            for child, _ in node.next_functions:
                if child is None:
                    continue
                if type(child) is _ACCUMULATE_GRAD:
                    owner = self._owners.get(id(cast(Any, child).variable))
                    if owner is not None and here is not owner[0]:
                        self._refuse_use(owner[0], owner[1])
                    continue
                layer = inner.get(child)
                if layer is not None and child not in outputs and here is not layer:
                    self._refuse_use(layer, None)
                if child not in seen:
                    seen.add(child)
                    stack.append(child)

    def _refuse_use(self, layer: nn.Module, param: str | None) -> None:
        what = f"parameter {param}" if param else "a parameter (or its autocast copy)"
        raise ValueError(
            f"{what} of module {self._labels[layer]!r} ({type(layer).__name__}) reaches the "
            "loss outside that module's forward (tied weights, F.linear(x, layer.weight), a "
            "weight read by another module, a penalty on the weights); GhostClipping sees "
            "only the module's own calls and would give it a wrong gradient: call the module "
            "itself, untie the weights, or use per_sample_grads()"
        )

    def _apply(
        self,
        loss: Tensor,
        records: list[_Record],
        max_norm: float | list[float],
        noise_std: float,
        generator: torch.Generator | None,
        reduction: str,
        mode: str,
    ) -> Tensor:
        batch = loss.shape[0]
        self._backward = True
        try:
            out_grads = torch.autograd.grad(
                loss.sum(), [r.output for r in records], allow_unused=True
            )
        finally:
            self._backward = False
        calls: dict[nn.Module, Calls] = {}
        for r, b in zip(records, out_grads, strict=True):
            if b is not None:  # None: this call did not reach the loss
                calls.setdefault(r.module, []).append((r.input, b))

        with torch.no_grad():
            layers: list[_LayerGrads | None] = []
            sq_norms: list[Tensor] = []
            for m, names, rule in zip(self._layers, self._layer_params, self._rules, strict=True):
                if m in calls:
                    layer = rule(m, calls[m], names, batch)
                    sq_norms.extend(layer.sq_norms)
                else:
                    layer = None
                    sq_norms.extend(loss.new_zeros(batch, dtype=loss.dtype) for _ in names)
                layers.append(layer)
            acc = max((s.dtype for s in sq_norms), key=lambda d: d == torch.float64)
            scale = 1.0 / batch if reduction == "mean" else 1.0
            factors, norms = _factors([s.to(acc) for s in sq_norms], max_norm, mode, scale)

            k = 0
            for m, names, layer in zip(self._layers, self._layer_params, layers, strict=True):
                params = [getattr(m, n) for n in names]
                if layer is not None:
                    sums = layer.sums(factors[k : k + len(names)], scale)
                else:  # no gradient reached it: only noise, if any
                    sums = [torch.zeros_like(p) for p in params] if noise_std > 0 else []
                k += len(names)
                for p, summed in zip(params, sums, strict=False):
                    _write(p, summed, noise_std * scale, generator)
        return norms
