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
  2023), so the whole step costs one forward and one backward pass.

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
import numbers
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from gradlab._common import EPS, as_tensor_list, check_threshold

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


def _check_noise(noise_multiplier: object, generator: object, max_norm: float | list[float]):
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, numbers.Real):
        raise ValueError(
            f"noise_multiplier must be a real number, got {type(noise_multiplier).__name__}"
        )
    sigma = float(noise_multiplier)
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {sigma!r}")
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


def _write(param: Tensor, summed: Tensor, noise_std: float, generator) -> None:
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


# ---------------------------------------------------------------- reference path


def per_sample_norms(grad_samples: Sequence[Tensor]) -> Tensor:
    r"""The 2-norm of each sample's gradient, per parameter: a ``(B, P)`` tensor.

    .. math::
        N_{i,l} = \| g^{(l)}_i \|_2 \quad\text{and}\quad
        \|g_i\|_2 = \bigl\| (N_{i,1}, \dots, N_{i,P}) \bigr\|_2 .

    Args:
        grad_samples: ``P`` tensors of shape ``(B, *param.shape)``.
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


def _check_pairs(parameters, grad_samples) -> tuple[list[Tensor], list[Tensor]]:
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
    parameters, grad_samples, max_norm, noise_multiplier, generator, reduction, mode
):
    params, samples = _check_pairs(parameters, grad_samples)
    max_norm = _check_max_norm(max_norm, len(params))
    _, noise_std = _check_noise(noise_multiplier, generator, max_norm)
    _check_reduction(reduction)
    batch = samples[0].shape[0]
    scale = 1.0 / batch if reduction == "mean" else 1.0
    with torch.no_grad():
        sq = [n.square() for n in per_sample_norms(samples).unbind(1)]
        factors, norms = _factors(sq, max_norm, mode, scale)
        for p, g, f in zip(params, samples, factors, strict=True):
            if mode == "clip":  # sum_i c_i g_i as one matrix-vector product
                summed = torch.tensordot(f.to(g.dtype), g, dims=1)
            else:
                summed = torch.where(f.view((batch,) + (1,) * p.dim()), g, 0).sum(0)
                if scale != 1.0:
                    summed = summed.mul_(scale)
            _write(p, summed, noise_std * scale, generator)
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
        parameters: the ``P`` tensors that receive the clipped sum in ``.grad``.
        grad_samples: ``P`` tensors of shape ``(B, *param.shape)``, in the order of
            ``parameters``: for instance the output of :func:`per_sample_grads`.
        max_norm: :math:`C`, a non-negative number (flat), or ``P`` numbers, one per
            parameter (per-layer).
        noise_multiplier: :math:`\sigma`; 0 (the default) adds no noise.
        generator: the random generator for the noise (seeded runs), or None.
        reduction: ``"sum"`` (default) or ``"mean"`` (divide by :math:`B`).

    Returns:
        The per-sample norms before clipping: ``(B,)`` (flat) or ``(B, P)``
        (per-layer).
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
    threshold. Arguments and return value as in :func:`clip_per_sample_`.
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
        model: the model; its trainable parameters (``requires_grad``) are
            differentiated, in ``model.parameters()`` order.
        loss_fn: ``loss_fn(model(x), *y)`` for a batch of one, a scalar or a
            one-element tensor (it is summed), e.g. ``nn.functional.cross_entropy``.
        inputs: the batch, ``(B, ...)``.
        targets: further per-sample tensors ``(B, ...)`` passed on to ``loss_fn``.
        chunk_size: passed to :func:`torch.func.vmap` to bound memory.
        randomness: passed to :func:`torch.func.vmap` (``"different"`` for dropout).

    Returns:
        A list of tensors of shape ``(B, *param.shape)``, one per trainable parameter.
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

    def loss_of_one(params, x, *y):
        out = functional_call(model, params, (x.unsqueeze(0),))
        return loss_fn(out, *(t.unsqueeze(0) for t in y)).sum()

    in_dims = (None, 0) + (0,) * len(targets)
    grads = vmap(grad(loss_of_one), in_dims=in_dims, chunk_size=chunk_size, randomness=randomness)(
        params, inputs, *targets
    )
    return [grads[n] for n in names]


# ---------------------------------------------------------------- ghost clipping


def _linear_sq_norms(a: Tensor, b: Tensor, weight: bool, bias: bool) -> list[Tensor]:
    r"""Per-sample squared norms of a Linear layer's weight and bias gradients.

    ``a``: ``(B, T, d_in)``, ``b``: ``(B, T, d_out)``. The weight's per-sample gradient
    is :math:`G_i = \sum_t b_{it} a_{it}^\top = b_i^\top a_i`, so

    .. math::
        \|G_i\|_F^2 = \langle a_i a_i^\top, b_i b_i^\top \rangle_F
        \;(\text{cost } T^2(d_\text{in} + d_\text{out})), \qquad
        \|G_i\|_F^2 = \|a_i\|^2 \|b_i\|^2 \;(T = 1),

    and when :math:`T^2 > d_\text{in} d_\text{out}` it is cheaper to form :math:`G_i`.
    The bias's per-sample gradient is :math:`\sum_t b_{it}`.
    """
    out = []
    seq, d_in, d_out = a.shape[1], a.shape[2], b.shape[2]
    if weight:
        if seq == 1:
            out.append(a.square().sum((1, 2)) * b.square().sum((1, 2)))
        elif seq * seq <= d_in * d_out:
            aa = torch.bmm(a, a.transpose(1, 2))
            bb = torch.bmm(b, b.transpose(1, 2))
            out.append((aa * bb).sum((1, 2)))
        else:
            out.append(torch.bmm(b.transpose(1, 2), a).square().sum((1, 2)))
    if bias:
        out.append(b.sum(1).square().sum(1))
    return out


def _embedding_sq_norm(ids: Tensor, b: Tensor) -> Tensor:
    r"""Per-sample squared norm of an Embedding's weight gradient.

    ``ids``: ``(B, T)``, ``b``: ``(B, T, d)``, padding positions already zeroed. Row
    :math:`v` of the per-sample gradient is :math:`\sum_{t: \text{id}_{it} = v} b_{it}`,
    so

    .. math::
        \|G_i\|_F^2 = \sum_{t, s} [\text{id}_{it} = \text{id}_{is}]\,
        \langle b_{it}, b_{is} \rangle .
    """
    if ids.shape[1] == 1:
        return b.square().sum((1, 2))
    same = ids.unsqueeze(2) == ids.unsqueeze(1)
    bb = torch.bmm(b, b.transpose(1, 2))
    return torch.where(same, bb, 0).sum((1, 2))


_NORMS = (nn.LayerNorm, nn.RMSNorm)
_SUPPORTED = (nn.Linear, nn.Embedding, *_NORMS)


def _min_dims(module: nn.Module) -> int:
    """The fewest dimensions a batched input of ``module`` has."""
    if isinstance(module, nn.Embedding):
        return 1
    if isinstance(module, _NORMS):
        return len(module.normalized_shape) + 1
    return 2


def _norm_layer_grads(module: nn.Module, x: Tensor, b: Tensor, names: list[str]) -> list[Tensor]:
    r"""Per-sample gradients of a LayerNorm's / RMSNorm's affine parameters, ``(B, *shape)``.

        They are as small as the parameters, so they are formed outright: with
        :math:`\hat x` the normalised input (recomputed),
        :math:`
    abla_\gamma \ell_i = \sum_t b_{it} \odot \hat x_{it}` and
        :math:`
    abla_eta \ell_i = \sum_t b_{it}`.
    """
    shape = tuple(module.normalized_shape)
    batch, dtype = x.shape[0], torch.promote_types(x.dtype, b.dtype)
    x, b = x.to(dtype), b.to(dtype)
    if isinstance(module, nn.LayerNorm):
        xhat = nn.functional.layer_norm(x, shape, None, None, module.eps)
    else:
        xhat = nn.functional.rms_norm(x, shape, None, module.eps)
    b = b.reshape(batch, -1, *shape)
    grads = {"bias": b.sum(1)}
    if "weight" in names:
        grads["weight"] = (b * xhat.reshape(batch, -1, *shape)).sum(1)
    return [grads[n] for n in names]


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
      the parameters and are formed outright. Dimension 0 is the batch.
    * Every trainable parameter must belong to a supported layer; a model with any
      other module holding trainable parameters is refused with a ValueError naming
      it (freeze it, or use :func:`per_sample_grads`). A parameter shared by two
      modules is refused too. The trainable set is read when the object is made.
    * A layer's input and output must not be modified in place after its forward
      (``nn.ReLU(inplace=True)`` right after a Linear is refused with a RuntimeError).
    * Parameters must act only through their layer's ``forward`` (no ``F.linear(x,
      layer.weight)`` elsewhere); a layer may be called several times per forward
      (its calls are summed, as autograd would).
    * The loss must be per sample (``reduction="none"``) and samples independent (no
      batch statistics).
    * Forward passes under ``torch.no_grad()`` are not recorded. The recordings are
      dropped by every :meth:`clip_` / :meth:`ignore_` that gets past its argument
      checks, and on leaving the block: one step per forward pass.
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self._layers: list[nn.Module] = []
        self._layer_params: list[list[str]] = []
        seen: dict[int, str] = {}
        for name, module in model.named_modules(remove_duplicate=True):
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            label = name or "<root>"
            for n, p in own:
                if id(p) in seen:
                    raise ValueError(
                        f"parameter {label}.{n} is shared with {seen[id(p)]}; GhostClipping "
                        "needs each parameter in one layer (use per_sample_grads())"
                    )
                seen[id(p)] = f"{label}.{n}"
            names = {n for n, _ in own}
            if not isinstance(module, _SUPPORTED) or not names <= {"weight", "bias"}:
                raise ValueError(
                    f"GhostClipping supports nn.Linear, nn.Embedding, nn.LayerNorm and "
                    f"nn.RMSNorm only; module "
                    f"{label!r} ({type(module).__name__}) has trainable parameters "
                    f"{sorted(names)}: freeze them or use per_sample_grads()"
                )
            if isinstance(module, nn.Embedding) and (module.scale_grad_by_freq or module.sparse):
                raise ValueError(
                    f"GhostClipping does not support nn.Embedding with scale_grad_by_freq or "
                    f"sparse gradients (module {label!r})"
                )
            self._layers.append(module)
            self._layer_params.append([n for n in ("weight", "bias") if n in names])
        if not self._layers:
            raise ValueError("model has no trainable parameters")
        self._records: dict[nn.Module, list[tuple[Tensor, Tensor]]] = {}
        self._handles: list = []

    @property
    def parameters(self) -> list[Tensor]:
        """The trainable parameters, in the order per-layer thresholds refer to."""
        return [
            getattr(m, n)
            for m, names in zip(self._layers, self._layer_params, strict=True)
            for n in names
        ]

    # ------------------------------------------------------------------ hooks

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Tensor) -> None:
        if torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad:
            x = args[0] if args else kwargs["input"]
            versions = (x._version, output._version)
            self._records.setdefault(module, []).append((x.detach(), output, versions))

    def __enter__(self) -> GhostClipping:
        if self._handles:
            raise RuntimeError("GhostClipping is already active")
        self._records.clear()
        self._handles = [
            m.register_forward_hook(self._hook, with_kwargs=True) for m in self._layers
        ]
        return self

    def __exit__(self, *exc) -> None:
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
            loss_per_sample: the ``(B,)`` losses of the batch just run forward inside
                the block (``reduction="none"``).
            max_norm, noise_multiplier, generator, reduction: as in
                :func:`clip_per_sample_`; per-layer thresholds follow
                :attr:`parameters`.

        Returns:
            The per-sample norms before clipping, ``(B,)`` or ``(B, P)``.
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
        ``.grad``. Arguments and return value as in :meth:`clip_`.
        """
        return self._step(
            loss_per_sample, max_norm, noise_multiplier, generator, reduction, "ignore"
        )

    def _step(self, loss, max_norm, noise_multiplier, generator, reduction, mode) -> Tensor:
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
        max_norm = _check_max_norm(max_norm, len(self.parameters))
        _, noise_std = _check_noise(noise_multiplier, generator, max_norm)
        _check_reduction(reduction)
        if not self._records:
            raise RuntimeError(
                "no forward pass of a supported layer was recorded: run the model inside the "
                "`with` block, with gradients enabled"
            )
        batch = loss.shape[0]
        for m, records in self._records.items():
            for a, out, versions in records:
                if (a._version, out._version) != versions:
                    raise RuntimeError(
                        f"the input or output of a {type(m).__name__} layer was modified in "
                        "place after its forward (e.g. by nn.ReLU(inplace=True)); ghost "
                        "clipping needs both as the layer saw them: use out-of-place ops"
                    )
                if a.dim() < _min_dims(m) or a.shape[0] != batch:
                    raise ValueError(
                        f"{type(m).__name__} input of shape {tuple(a.shape)} does not start "
                        f"with the batch dimension of loss_per_sample ({batch})"
                    )
        try:
            return self._apply(loss, max_norm, noise_std, generator, reduction, mode)
        finally:
            self._records.clear()

    def _apply(self, loss, max_norm, noise_std, generator, reduction, mode) -> Tensor:
        batch = loss.shape[0]
        outputs = [out for m in self._layers for _, out, _ in self._records.get(m, ())]
        out_grads = iter(torch.autograd.grad(loss.sum(), outputs, allow_unused=True))

        # Per layer: a (B, T, d_in) or ids (B, T), b (B, T, d_out), calls concatenated.
        # Norm layers: their per-sample gradients, (B, *param.shape), summed over calls.
        acts: dict[nn.Module, tuple[Tensor, Tensor]] = {}
        formed: dict[nn.Module, list[Tensor]] = {}
        for m, names in zip(self._layers, self._layer_params, strict=True):
            if m not in self._records:
                continue
            a_parts, b_parts = [], []
            for a, _out, _ in self._records[m]:
                b = next(out_grads)
                if b is None:  # this call did not reach the loss
                    continue
                if isinstance(m, _NORMS):
                    with torch.no_grad():
                        grads = _norm_layer_grads(m, a, b, names)
                    if m in formed:
                        grads = [g + h for g, h in zip(formed[m], grads, strict=True)]
                    formed[m] = grads
                    continue
                if isinstance(m, nn.Embedding):
                    a = a.reshape(batch, -1)
                    b = b.reshape(batch, -1, m.embedding_dim)
                    if m.padding_idx is not None:
                        b = torch.where((a == m.padding_idx).unsqueeze(-1), 0, b)
                else:
                    a = a.reshape(batch, -1, m.in_features)
                    b = b.reshape(batch, -1, m.out_features)
                    if a.dtype != b.dtype:  # autocast: the layer ran in lower precision
                        common = torch.promote_types(a.dtype, b.dtype)
                        a, b = a.to(common), b.to(common)
                a_parts.append(a)
                b_parts.append(b)
            if a_parts:
                cat = (lambda t: t[0]) if len(a_parts) == 1 else (lambda t: torch.cat(t, 1))
                acts[m] = (cat(a_parts), cat(b_parts))

        with torch.no_grad():
            sq_norms: list[Tensor] = []
            for m, names in zip(self._layers, self._layer_params, strict=True):
                if m in formed:
                    sq_norms.extend(
                        torch.linalg.vector_norm(
                            g.reshape(batch, -1), 2, dim=1, dtype=_acc_dtype(g.dtype)
                        ).square()
                        for g in formed[m]
                    )
                    continue
                if m not in acts:
                    sq_norms.extend(loss.new_zeros(batch, dtype=loss.dtype) for _ in names)
                    continue
                a, b = acts[m]
                b = b.to(_acc_dtype(b.dtype))
                if isinstance(m, nn.Embedding):
                    sq_norms.append(_embedding_sq_norm(a, b))
                else:
                    a = a.to(b.dtype)
                    sq_norms.extend(_linear_sq_norms(a, b, "weight" in names, "bias" in names))
            acc = max((s.dtype for s in sq_norms), key=lambda d: d == torch.float64)
            scale = 1.0 / batch if reduction == "mean" else 1.0
            factors, norms = _factors([s.to(acc) for s in sq_norms], max_norm, mode, scale)

            k = 0
            for m, names in zip(self._layers, self._layer_params, strict=True):
                if m in formed:
                    for n, g in zip(names, formed[m], strict=True):
                        f = factors[k]
                        k += 1
                        if mode == "clip":
                            summed = torch.tensordot(f.to(g.dtype), g, dims=1)
                        else:
                            summed = torch.where(f.view((batch,) + (1,) * (g.dim() - 1)), g, 0)
                            summed = summed.sum(0)
                            if scale != 1.0:
                                summed = summed.mul_(scale)
                        _write(getattr(m, n), summed, noise_std * scale, generator)
                    continue
                if m not in acts:  # no gradient reached it: only noise, if any
                    for n in names if noise_std > 0 else ():
                        p = getattr(m, n)
                        _write(p, torch.zeros_like(p), noise_std * scale, generator)
                    k += len(names)
                    continue
                a, b = acts[m]
                last, weighted = None, None
                for n in names:
                    f = factors[k]
                    k += 1
                    if f is not last:  # weight and bias share a flat coefficient
                        if mode == "clip":
                            weighted = (b * f.to(b.dtype).view(batch, 1, 1), a)
                        else:
                            keep = f.view(batch, 1, 1)
                            bw = torch.where(keep, b, 0)
                            if scale != 1.0:
                                bw = bw * scale
                            aw = a if isinstance(m, nn.Embedding) else torch.where(keep, a, 0)
                            weighted = (bw, aw)
                        last = f
                    bw, aw = weighted
                    _write(getattr(m, n), _bookkeep(m, n, aw, bw), noise_std * scale, generator)
        return norms


def _bookkeep(module: nn.Module, name: str, a: Tensor, b: Tensor) -> Tensor:
    r"""The (reweighted) batch gradient :math:`\sum_i \nabla \ell_i` of one parameter."""
    if isinstance(module, nn.Embedding):
        d = module.embedding_dim
        grad = b.new_zeros(module.num_embeddings, d)
        return grad.index_add_(0, a.reshape(-1), b.reshape(-1, d))
    if name == "bias":
        return b.sum((0, 1))
    return b.reshape(-1, b.shape[-1]).T @ a.reshape(-1, a.shape[-1])
