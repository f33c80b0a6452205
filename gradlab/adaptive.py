r"""Adaptive thresholds and unit-wise clipping: AutoClip, ZClip, a σ-rule skip, and AGC.

A *threshold policy* chooses the threshold of each step from the statistics of the
steps before it (the gradient norm, or the loss). :class:`gradlab.StepGuard` accepts
one in place of a fixed number and, at every step, calls

.. code-block:: python

    tau = policy.threshold(stat)      # compare stat against tau: clip or skip
    policy.update(stat, accepted)     # then fold the step into the state

Every policy here keeps rejected and non-finite steps out of its statistics. The
usual implementations append every norm to their history, so that one NaN norm turns
an EMA into NaN for good, or every later percentile into NaN, or makes a σ-window skip
reject every step until the NaN leaves the window. Here :meth:`update` changes the
state only where ``accepted`` is true *and* the statistic is finite, with device-side
selects (``torch.where``, never a multiplication by 0, since ``NaN * 0`` is NaN);
otherwise the state stays the same bit for bit.

The state lives in tensors on the statistic's device. ``threshold`` and ``update``
never read a value on the host and never branch in Python on one, so they do not
synchronise a GPU and compile with ``torch.compile(fullgraph=True)`` into one graph
that does not recompile when the values change (build the policy on the statistic's
device, ``device=...``, so that its state does not move inside the compiled region).

Cost: eagerly, a step of ``threshold`` and ``update`` is a few dozen kernels on 0-dim
tensors (AutoClip also sorts its window), about 80 to 200 µs on one CPU core
(``benchmarks/bench_adaptive.py``), whatever the model's size. Compiled, ZClip and
SigmaSkip fuse to about 55 µs, mostly call overhead; AutoClip's sort remains.

:func:`agc_` is not a policy but a clipping function like
:func:`gradlab.clip_grad_norm_`: adaptive gradient clipping, unit by unit, relative
to the weights.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, Self, runtime_checkable

import torch
from torch import Tensor

from gradlab._common import as_tensor_list, check_foreach, check_int, check_real, use_foreach

__all__ = ["AutoClip", "SigmaSkip", "ThresholdPolicy", "ZClip", "agc_"]

TensorOrTensors = Tensor | Iterable[Tensor]

_INF = math.inf


# ------------------------------------------------------------------------ protocol


@runtime_checkable
class ThresholdPolicy(Protocol):
    """What :class:`gradlab.StepGuard` needs from an adaptive threshold.

    * ``threshold(stat)`` returns the threshold for this step's statistic, a 0-dim
      tensor on the statistic's device, and has no side effect on the values of the
      state.
    * ``update(stat, accepted)`` folds the step into the state. ``accepted`` is a
      0-dim bool tensor. The state changes only where ``accepted`` is true and
      ``stat`` is finite; otherwise it stays the same bit for bit.
    * ``state_dict()`` / ``load_state_dict()`` round-trip the state, so a run
      resumed from a checkpoint gets the same thresholds bit for bit.

    Neither ``threshold`` nor ``update`` reads a tensor value on the host.
    """

    def threshold(self, stat: Tensor) -> Tensor: ...

    def update(self, stat: Tensor, accepted: Tensor | bool) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...


# -------------------------------------------------------------------------- checks


def _check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
    return dtype


# ---------------------------------------------------------------- shared machinery


class _Policy:
    """State held in named tensors; conversion of the inputs; checkpoints; devices.

    Subclasses create their state tensors in ``_initial_state`` and list their
    hyperparameters in ``_config``; ``load_state_dict`` insists on the same
    hyperparameters, since a state is only meaningful for the policy that made it.
    """

    def __init__(self, device: torch.device | str | None, dtype: torch.dtype) -> None:
        self._dtype = _check_dtype(dtype)
        self._device = torch.device("cpu" if device is None else device)
        self._state: dict[str, Tensor] = {
            name: t.to(self._device) for name, t in self._initial_state().items()
        }
        # The device a tensor actually lands on ("cuda" becomes "cuda:0"), so that the
        # comparison with a statistic's device in _prepare is exact.
        self._device = next(iter(self._state.values())).device

    # -- to be provided by subclasses
    def _initial_state(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def _config(self) -> dict[str, Any]:
        raise NotImplementedError

    # -- properties
    @property
    def device(self) -> torch.device:
        """The device the state lives on (it follows the statistics)."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype in which the statistics are stored and combined."""
        return self._dtype

    def to(self, device: torch.device | str) -> Self:
        """Move the state to ``device`` (a copy once; the values do not change)."""
        self._state = {name: t.to(device) for name, t in self._state.items()}
        self._device = next(iter(self._state.values())).device
        return self

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The hyperparameters and a copy of every state tensor."""
        return {
            "config": self._config(),
            "state": {name: t.detach().clone() for name, t in self._state.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` of an identically built policy.

        The tensors are copied into the existing ones (so a compiled step that holds
        them does not recompile), whatever device they were saved from.

        Raises:
            ValueError: the hyperparameters differ, or a tensor is missing or has
                another shape or dtype.
        """
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"config", "state"}:
            raise ValueError("state_dict must be a mapping with the keys 'config' and 'state'")
        config, saved = dict(state_dict["config"]), state_dict["state"]
        if config != self._config():
            raise ValueError(
                f"state_dict was saved by a {type(self).__name__} with {config}, "
                f"but this one has {self._config()}"
            )
        if not isinstance(saved, Mapping) or set(saved) != set(self._state):
            raise ValueError(f"state_dict['state'] must hold exactly {sorted(self._state)}")
        for name, mine in self._state.items():
            theirs = saved[name]
            if not isinstance(theirs, Tensor) or (theirs.shape, theirs.dtype) != (
                mine.shape,
                mine.dtype,
            ):
                raise ValueError(
                    f"state_dict['state'][{name!r}] must be a {mine.dtype} tensor of shape "
                    f"{tuple(mine.shape)}"
                )
        with torch.no_grad():
            for name, mine in self._state.items():
                mine.copy_(saved[name])

    # -- inputs
    def _prepare(self, stat: Tensor | float) -> Tensor:
        """The statistic as a 0-dim tensor of the state's dtype, on the state's device.

        A statistic on another device moves the state there first (a copy, once):
        the policy lives where the statistics are computed.
        """
        if not isinstance(stat, Tensor):
            if isinstance(stat, bool) or not isinstance(stat, numbers.Real):
                raise ValueError(f"stat must be a tensor or a real number, got {stat!r}")
            stat = torch.tensor(float(stat), dtype=self._dtype, device=self._device)
        if stat.numel() != 1:
            raise ValueError(f"stat must hold a single number, got shape {tuple(stat.shape)}")
        if stat.device != self._device:
            self.to(stat.device)
        # Each skipped no-op below is one dispatch less, on every step.
        stat = stat.detach() if stat.dim() == 0 else stat.detach().reshape(())
        return stat if stat.dtype == self._dtype else stat.to(self._dtype)

    def _usable(self, x: Tensor, accepted: Tensor | bool) -> Tensor:
        """0-dim bool: may this step enter the statistics (accepted and finite)?

        Finiteness is checked after the conversion to the state's dtype, so that a
        float64 statistic too large for a float32 state counts as infinite.
        """
        if isinstance(accepted, bool):
            accepted = torch.tensor(accepted, device=x.device)
        if not isinstance(accepted, Tensor) or accepted.dtype != torch.bool:
            raise ValueError(f"accepted must be a bool tensor or a bool, got {accepted!r}")
        if accepted.numel() != 1:
            raise ValueError(f"accepted must hold one value, got shape {tuple(accepted.shape)}")
        if accepted.dim() != 0:
            accepted = accepted.reshape(())
        if accepted.device != x.device:
            accepted = accepted.to(x.device)
        # |x| < inf is isfinite (NaN compares false) in two kernels instead of five.
        return accepted & (x.abs() < _INF)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args})"


def _ring_write_(buffer: Tensor, count: Tensor, x: Tensor, ok: Tensor) -> None:
    """Put ``x`` in the ring ``buffer`` at ``count % len`` where ``ok``; else keep it.

    Written with index_put_ on a 1-element index, not ``buffer[i] = ...``: indexing
    with a 0-dim tensor reads the index on the host. Where ``ok`` is false the slot is
    rewritten with its own value, which keeps every bit.
    """
    slot = torch.remainder(count, buffer.numel()).reshape(1)
    old = buffer.gather(0, slot)
    buffer.index_put_((slot,), torch.where(ok, x.reshape(1), old))


def _count_up_(count: Tensor, ok: Tensor) -> None:
    count.copy_(torch.where(ok, count + 1, count))


# ------------------------------------------------------------------------ AutoClip


class AutoClip(_Policy):
    r"""AutoClip: the threshold is a quantile of the recent accepted statistics.

    With :math:`x_{(0)} \le \dots \le x_{(n-1)}` the last
    :math:`n = \min(N, \text{window})` of the :math:`N` accepted, finite statistics,
    sorted, and :math:`q` the ``quantile``:

    .. math::
        r = q\,(n - 1), \qquad
        \tau = x_{(\lfloor r \rfloor)}
            + (r - \lfloor r \rfloor)\,\bigl(x_{(\lceil r \rceil)} - x_{(\lfloor r \rfloor)}\bigr),

    the linear interpolation of :func:`torch.quantile` and ``numpy.percentile`` (and
    the same bits as :func:`torch.quantile` on those values). Before the first
    accepted step, :math:`\tau = \infty`.

    The window is a ring buffer of ``window`` slots padded with :math:`+\infty`: a
    sort puts the :math:`n` filled slots first, and the two order statistics are
    gathered at ranks computed from the count on the device, so no value is read on
    the host. Each ``threshold`` call sorts the window (:math:`O(w \log w)`).

    The defaults are those of the authors' ``autoclip`` package
    (``QuantileClip(quantile=0.9, history_length=1000)``, whose threshold also leaves
    out the current norm), used with ``global_threshold=True``: one threshold for the
    total norm, not one per parameter tensor. Differences, deliberate: the package
    appends every norm to its history, NaN included (``torch.quantile`` is then NaN
    until the NaN leaves the window), and the paper's sample code appends every norm
    to an unbounded history, the current one included, before taking the percentile
    the caller chose. Here only accepted, finite statistics enter.

    Args:
        quantile: :math:`q \in [0, 1]`.
        window: how many of the most recent accepted statistics are kept.
        device: where the state starts (it moves to the statistic's device on first
            use); ``None`` means the CPU.
        dtype: ``torch.float32`` or ``torch.float64``, the dtype of the state.

    References:
        P. Seetharaman, G. Wichern, B. Pardo, J. Le Roux. *AutoClip: Adaptive
        gradient clipping for source separation networks.* IEEE MLSP 2020,
        arXiv:2007.14469.
    """

    def __init__(
        self,
        quantile: float = 0.9,
        window: int = 1000,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.quantile = check_real("quantile", quantile, 0.0, 1.0)
        self.window = check_int("window", window, 1)
        super().__init__(device, dtype)

    def _initial_state(self) -> dict[str, Tensor]:
        return {
            "values": torch.full((self.window,), _INF, dtype=self._dtype),
            # Accepted steps ever; the filled slots are min(count, window).
            "count": torch.zeros((), dtype=torch.int64),
        }

    def _config(self) -> dict[str, Any]:
        return {"quantile": self.quantile, "window": self.window}

    def threshold(self, stat: Tensor) -> Tensor:
        """The ``quantile`` of the window (``inf`` while it is empty)."""
        self._prepare(stat)  # checks it and brings the state to its device
        values, count = self._state["values"], self._state["count"]
        filled = count.clamp(max=self.window)
        ordered = values.sort().values
        # As torch.quantile computes its ranks: q * (n - 1) in the values' dtype.
        ranks = (filled - 1).clamp(min=0).to(self._dtype) * self.quantile
        below = ranks.to(torch.int64)
        above = ranks.ceil().to(torch.int64)
        low = ordered.gather(0, below.reshape(1))
        high = ordered.gather(0, above.reshape(1))
        tau = torch.lerp(low, high, (ranks - below).reshape(1)).reshape(())
        return torch.where(filled > 0, tau, _INF)

    def update(self, stat: Tensor, accepted: Tensor | bool) -> None:
        """Append ``stat`` to the window where accepted and finite."""
        x = self._prepare(stat)
        ok = self._usable(x, accepted)
        values, count = self._state["values"], self._state["count"]
        _ring_write_(values, count, x, ok)
        _count_up_(count, ok)


# --------------------------------------------------------------------------- ZClip


class ZClip(_Policy):
    r"""ZClip: clip where the z-score of the statistic against its EMA is too high.

    State: an exponential moving mean :math:`\mu` and variance :math:`\sigma^2`.
    With :math:`z = (x - \mu) / (\sigma + \varepsilon)` and :math:`z_t` = ``z_thresh``,
    the threshold ("adaptive scaling") is

    .. math::
        \tau = \begin{cases}
            \mu + z_t^2\,\sigma / z & z > z_t, \\
            \infty & \text{otherwise,}
        \end{cases}

    so a spike is clipped further below :math:`\mu + z_t\sigma` the larger it is.
    An accepted, finite statistic then updates the EMA with its *clipped* value
    :math:`\hat x = \min(x, \tau)`, the new :math:`\mu` entering the variance:

    .. math::
        \mu \leftarrow \alpha\mu + (1 - \alpha)\hat x, \qquad
        \sigma^2 \leftarrow \alpha\sigma^2 + (1 - \alpha)(\hat x - \mu)^2 .

    Warm-up: the first ``warmup`` accepted statistics are collected as they are, and
    :math:`\mu, \sigma^2` are set to their mean and population variance. Until then
    the threshold is :math:`\infty`, or ``max_norm`` if given.

    Differences from the reference implementation (``bluorion-com/ZClip``), where
    this statement and it differ: there a NaN or infinite norm enters the warm-up
    buffer or the EMA like any other and poisons it for the rest of the run, every
    norm is read on the host (``.item()``), and ``max_grad_norm`` (1.0 by default)
    caps the threshold at *every* step, warm-up and after. Here non-finite and
    rejected steps are left out, nothing is read on the host, and ``max_norm`` (off
    by default) applies during warm-up only. The reference's ``clip_factor``,
    ``skip_update_on_spike`` and its ``"mean"`` and ``"percentile"`` options are not
    provided.

    Args:
        alpha: :math:`\alpha \in [0, 1)`, the EMA's memory.
        z_thresh: :math:`z_t > 0`.
        warmup: how many accepted statistics initialise the EMA, at least 1.
        eps: :math:`\varepsilon \ge 0` in the z-score's denominator.
        max_norm: the fixed threshold during warm-up (``None``: no threshold).
        device: where the state starts (it follows the statistic's device).
        dtype: ``torch.float32`` or ``torch.float64``, the dtype of the state.

    References:
        A. Kumar, L. Owen, N. R. Chowdhury, F. Güra. *ZClip: Adaptive spike
        mitigation for LLM pre-training.* arXiv:2504.02507, 2025.
    """

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        warmup: int = 25,
        eps: float = 1e-6,
        max_norm: float | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.alpha = check_real("alpha", alpha, 0.0, 1.0)
        if self.alpha == 1.0:
            raise ValueError("alpha must be in [0, 1), got 1.0 (the EMA would never move)")
        self.z_thresh = check_real("z_thresh", z_thresh, 0.0, open_low=True)
        if math.isinf(self.z_thresh):
            raise ValueError("z_thresh must be finite, got inf")
        self.warmup = check_int("warmup", warmup, 1)
        self.eps = check_real("eps", eps, 0.0)
        self.max_norm = None if max_norm is None else check_real("max_norm", max_norm, 0.0)
        super().__init__(device, dtype)

    def _initial_state(self) -> dict[str, Tensor]:
        return {
            "warm": torch.zeros((self.warmup,), dtype=self._dtype),
            "count": torch.zeros((), dtype=torch.int64),  # accepted steps ever
            "mean": torch.zeros((), dtype=self._dtype),
            "var": torch.zeros((), dtype=self._dtype),
        }

    def _config(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "z_thresh": self.z_thresh,
            "warmup": self.warmup,
            "eps": self.eps,
            "max_norm": self.max_norm,
        }

    def _adaptive(self, x: Tensor) -> Tensor:
        """The post-warm-up threshold of ``x``: μ + z_t²σ/z where z > z_t, else inf."""
        mean, std = self._state["mean"], self._state["var"].sqrt()
        z = (x - mean) / (std + self.eps)
        over = z > self.z_thresh
        # z > z_t > 0 wherever the quotient is used; elsewhere divide by 1, not by 0.
        scaled = mean + (self.z_thresh**2) * std / torch.where(over, z, 1.0)
        return torch.where(over, scaled, _INF)

    def threshold(self, stat: Tensor) -> Tensor:
        """The adaptive threshold of ``stat``; during warm-up ``max_norm`` or ``inf``."""
        x = self._prepare(stat)
        fixed = _INF if self.max_norm is None else self.max_norm
        warming = self._state["count"] < self.warmup
        return torch.where(warming, fixed, self._adaptive(x))

    def update(self, stat: Tensor, accepted: Tensor | bool) -> None:
        """Collect ``stat`` during warm-up, then update the EMA with its clipped value."""
        x = self._prepare(stat)
        ok = self._usable(x, accepted)
        warm, count = self._state["warm"], self._state["count"]
        mean, var = self._state["mean"], self._state["var"]
        warming = count < self.warmup
        # Warm-up: collect x; the step that fills the buffer initialises the EMA.
        _ring_write_(warm, count, x, ok & warming)
        completes = ok & (count == self.warmup - 1)
        warm_mean = warm.mean()
        warm_var = (warm - warm_mean).square().mean()
        # After warm-up: the EMA update with x clipped at its own threshold.
        clipped = torch.minimum(x, self._adaptive(x))
        ema_mean = self.alpha * mean + (1 - self.alpha) * clipped
        ema_var = self.alpha * var + (1 - self.alpha) * (clipped - ema_mean).square()
        moves = ok & ~warming
        mean_new = torch.where(completes, warm_mean, torch.where(moves, ema_mean, mean))
        var_new = torch.where(completes, warm_var, torch.where(moves, ema_var, var))
        mean.copy_(mean_new)
        var.copy_(var_new)
        _count_up_(count, ok)


# ----------------------------------------------------------------------- SigmaSkip


class SigmaSkip(_Policy):
    r"""The σ rule: a statistic far above the recent ones is over the threshold.

    With :math:`x_1, \dots, x_n` the last :math:`n = \min(N, \text{window})` of the
    :math:`N` accepted, finite statistics and :math:`k` the ``k``:

    .. math::
        \bar x = \frac1n \sum_i x_i, \qquad
        s = \sqrt{\frac{1}{n - 1} \sum_i (x_i - \bar x)^2}, \qquad
        \tau = \begin{cases} \bar x + k s & n \ge \text{min\_count}, \\
                             \infty & \text{otherwise,} \end{cases}

    :math:`s` being the sample standard deviation of :func:`torch.std`. Meant for
    ``StepGuard(mode="skip")``, on the gradient norm or on the loss: a skipped step
    is not accepted, so a spike never widens the window that judged it.

    Differences from OLMo-core's ``SkipStepOptimizer``, deliberate: it keeps every
    step's loss and norm in its window, skipped steps included (and, in the versions
    that do not filter non-finite values, NaN ones, so that one NaN skips every step
    until it leaves the window); it starts once its list, the current step included,
    holds ``max(2, window // 2)`` values; and it tests :math:`x - \bar x \le k s`
    rather than :math:`x \le \bar x + k s`. Here only accepted, finite statistics
    enter, and ``min_count`` counts those.

    Args:
        k: :math:`k \ge 0`, in standard deviations.
        window: how many of the most recent accepted statistics are kept.
        min_count: below this many, no threshold; ``2 <= min_count <= window``.
        device: where the state starts (it follows the statistic's device).
        dtype: ``torch.float32`` or ``torch.float64``, the dtype of the state.

    References:
        D. Groeneveld et al. (AI2). OLMo-core, ``olmo_core.optim.SkipStepOptimizer``,
        https://github.com/allenai/OLMo-core; Team OLMo. *2 OLMo 2 Furious.*
        arXiv:2501.00656, 2025.
    """

    def __init__(
        self,
        k: float = 6.0,
        window: int = 128,
        min_count: int = 64,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.k = check_real("k", k, 0.0)
        if math.isinf(self.k):
            raise ValueError("k must be finite, got inf")
        self.window = check_int("window", window, 2)
        self.min_count = check_int("min_count", min_count, 2)
        if self.min_count > self.window:
            raise ValueError(f"min_count must be <= window ({self.window}), got {min_count}")
        super().__init__(device, dtype)

    def _initial_state(self) -> dict[str, Tensor]:
        return {
            "values": torch.zeros((self.window,), dtype=self._dtype),
            "count": torch.zeros((), dtype=torch.int64),  # accepted steps ever
        }

    def _config(self) -> dict[str, Any]:
        return {"k": self.k, "window": self.window, "min_count": self.min_count}

    def threshold(self, stat: Tensor) -> Tensor:
        """Mean + k·std of the window (``inf`` below ``min_count`` values)."""
        x = self._prepare(stat)
        values, count = self._state["values"], self._state["count"]
        filled = count.clamp(max=self.window)
        valid = torch.arange(self.window, device=x.device) < filled
        # Clamped denominators keep the unused branch free of 0/0 before min_count.
        n = filled.clamp(min=2).to(self._dtype)
        mean = torch.where(valid, values, 0.0).sum() / n
        var = torch.where(valid, (values - mean).square(), 0.0).sum() / (n - 1)
        tau = mean + self.k * var.sqrt()
        return torch.where(filled >= self.min_count, tau, _INF)

    def update(self, stat: Tensor, accepted: Tensor | bool) -> None:
        """Append ``stat`` to the window where accepted and finite."""
        x = self._prepare(stat)
        ok = self._usable(x, accepted)
        values, count = self._state["values"], self._state["count"]
        _ring_write_(values, count, x, ok)
        _count_up_(count, ok)


# ----------------------------------------------------------------------------- AGC


def _unit_norms(tensors: list[Tensor], vectorised: bool) -> Tensor:
    """The 2-norm of every unit of every tensor, concatenated in order (float32 at least).

    A unit is an output row (dims 1..n) of a tensor with two or more dims and the
    whole tensor otherwise. The whole-tensor norms go through one foreach call; row
    norms need a reduction over dims 1..n, one kernel per tensor. A norm that
    overflows is infinite, and its unit counts as non-finite.
    """
    norm_dtype = torch.float32 if tensors[0].dtype in (torch.float16, torch.bfloat16) else None
    whole = [t for t in tensors if t.dim() <= 1]
    if vectorised and whole:
        whole_norms = iter(torch._foreach_norm(whole, 2.0, dtype=norm_dtype))
    else:
        whole_norms = iter(torch.linalg.vector_norm(t, dtype=norm_dtype) for t in whole)
    pieces = []
    for t in tensors:
        if t.dim() <= 1:
            pieces.append(next(whole_norms).reshape(1))
        else:
            dims = tuple(range(1, t.dim()))
            pieces.append(torch.linalg.vector_norm(t, 2.0, dim=dims, dtype=norm_dtype))
    return torch.cat(pieces)


def _agc_coefficients(grad_norms: Tensor, weight_norms: Tensor, clip_factor: float, eps: float):
    """min(1, λ·max(‖W‖, eps)/‖G‖) per unit, and 1 for a unit that is not finite.

    ``‖G‖ > λ·max(‖W‖, eps) >= λ·eps > 0`` wherever the quotient is used, so a zero
    gradient unit is never divided by (no 0/0). A NaN weight norm gives a NaN bound,
    which no norm exceeds: the unit is left alone. An infinite or NaN gradient norm
    is left alone too, because scaling it would turn ``inf`` entries into NaN
    (``inf * 0``) and spread NaN over the whole unit.
    """
    bound = clip_factor * torch.clamp(weight_norms, min=eps)
    # A norm is >= 0 or NaN, so "< inf" is isfinite, in one kernel instead of five.
    clip = (grad_norms < _INF) & (grad_norms > bound)
    coef = torch.where(clip, bound / torch.where(clip, grad_norms, 1.0), 1.0)
    return coef, clip


def _agc_group(params: list[Tensor], grads: list[Tensor], clip_factor: float, eps: float, foreach):
    """Clip one (device, dtype) group in place; return how many units were clipped."""
    device = grads[0].device
    vectorised = use_foreach(grads, device, foreach)
    grad_norms = _unit_norms(grads, vectorised)
    weight_norms = _unit_norms(params, vectorised)
    if weight_norms.dtype != grad_norms.dtype:  # weights kept in another dtype
        weight_norms = weight_norms.to(grad_norms.dtype)
    coef, clip = _agc_coefficients(grad_norms, weight_norms, clip_factor, eps)
    if coef.dtype != grads[0].dtype:  # 16-bit gradients, norms in float32
        coef = coef.to(grads[0].dtype)
    # One coefficient per unit, shaped to broadcast over that unit's entries.
    sizes = [g.shape[0] if g.dim() > 1 else 1 for g in grads]
    factors = [
        c.reshape((-1,) + (1,) * (g.dim() - 1)) if g.dim() > 1 else c.reshape(())
        for c, g in zip(coef.split(sizes), grads, strict=True)
    ]
    if vectorised:
        torch._foreach_mul_(grads, factors)
    else:
        for g, f in zip(grads, factors, strict=True):
            g.mul_(f)
    return clip.sum()


def agc_(
    parameters: TensorOrTensors,
    clip_factor: float = 0.01,
    eps: float = 1e-3,
    exclude: TensorOrTensors = (),
    foreach: bool | None = None,
) -> Tensor:
    r"""Adaptive gradient clipping, unit by unit, relative to the weights (NFNets).

    For every unit :math:`i` (an output row of a weight, i.e. its dims 1..n; the
    whole tensor for a vector or a scalar), with :math:`W_i` its weights,
    :math:`G_i` their gradient and :math:`\lambda` the ``clip_factor``:

    .. math::
        G_i \leftarrow G_i \cdot \min\Bigl(1,
            \frac{\lambda \max(\|W_i\|_2, \text{eps})}{\|G_i\|_2}\Bigr),

    so that :math:`\|G_i\| \le \lambda \max(\|W_i\|, \text{eps})`: a step may change
    a unit's weights by about a fraction :math:`\lambda` of their norm (times the
    learning rate), whatever the scale of the layer. ``eps`` keeps units whose
    weights start at zero (biases) able to move.

    Non-finite units: a unit whose gradient norm is NaN or infinite, or whose weight
    norm is NaN, is left exactly as it is. Scaling it would only spread NaN over the
    unit (``inf * 0`` is NaN), and leaving it lets a guard such as
    :class:`gradlab.StepGuard` still see the non-finite gradient and skip the step.
    A finite gradient never becomes NaN: a zero unit stays zero (it is never divided
    by), and a finite unit is only ever multiplied by a finite factor of at most 1.

    The coefficients are computed on the device and always applied (times 1 where
    nothing is clipped), so no value is read on the host. Gradients are grouped by
    device and dtype. The whole-tensor norms take one foreach kernel where available;
    row norms take one reduction per tensor, and the coefficients of all units are
    computed together, then applied with one ``torch._foreach_mul_`` call (which torch
    runs tensor by tensor, since each coefficient broadcasts over its unit).

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped in
            place; tensors without a gradient are skipped.
        clip_factor: :math:`\lambda > 0`. The paper uses 0.01 at batch size 4096;
            it finds that larger batches need smaller values.
        eps: the smallest weight norm a unit is measured against, ``> 0``.
        exclude: parameters (tensors, compared by identity) to leave alone,
            typically the final classifier layer, which the paper does not clip.
        foreach: ``None`` picks the foreach kernels where the device supports them;
            ``True`` demands them (RuntimeError where unsupported); ``False`` loops.

    Returns:
        How many units were clipped, a 0-dim int64 tensor on the first gradient's
        device (``tensor(0)`` when there is none): the clip rate to log, with no
        host read.

    References:
        A. Brock, S. De, S. L. Smith, K. Simonyan. *High-performance large-scale
        image recognition without normalization.* ICML 2021, arXiv:2102.06171.
    """
    clip_factor = check_real("clip_factor", clip_factor, 0.0, open_low=True)
    if math.isinf(clip_factor):
        raise ValueError("clip_factor must be finite, got inf")
    eps = check_real("eps", eps, 0.0, open_low=True)
    if math.isinf(eps):
        raise ValueError("eps must be finite, got inf")
    check_foreach(foreach)
    params = as_tensor_list(parameters, "parameters")
    skip = {id(t) for t in as_tensor_list(exclude, "exclude")}
    pairs = [(p, p.grad) for p in params if p.grad is not None and id(p) not in skip]
    if not pairs:
        return torch.zeros((), dtype=torch.int64)
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[Tensor, Tensor]]] = {}
    for p, g in pairs:
        groups.setdefault((g.device, g.dtype), []).append((p, g))
    first_device = pairs[0][1].device
    clipped = torch.zeros((), dtype=torch.int64, device=first_device)
    with torch.no_grad():
        for members in groups.values():
            # Under no_grad the weights can be read as they are, without detach().
            ps = [p for p, _ in members]
            gs = [g for _, g in members]
            clipped += _agc_group(ps, gs, clip_factor, eps, foreach).to(first_device)
    return clipped
