r"""Adaptive thresholds and unit-wise clipping: AutoClip, ZClip, a σ-rule skip, and AGC.

A *threshold policy* chooses the threshold of each step from the statistics seen so far
(the gradient norm, or the loss). :class:`gradlab.StepGuard` accepts one in place of a
fixed number and, at every step, calls

.. code-block:: python

    tau = policy.threshold(stat)   # compare stat against tau: clip or skip
    policy.update(stat, taken)     # taken: 0-dim bool, "the optimizer took this step"

and compares ``stat`` with ``tau`` without torch's ``1e-6`` (the norms a policy follows
may be far smaller). **What enters a policy's statistics is the policy's choice**, given
in its docstring:

============================ ============================================ =============
policy                       what enters                                  as its source
============================ ============================================ =============
``AutoClip``                 every finite statistic, step taken or not    yes
``ZClip``                    every finite statistic, as its clipped value yes
``SigmaSkip()``              every finite statistic, step taken or not    yes
``SigmaSkip(steps="taken")`` the finite statistics of the taken steps     no: a variant
============================ ============================================ =============

A rule that learns only from the steps it let through ratchets in ``"skip"`` mode: the
norms above its threshold never enter, so the next threshold is a quantile of a
truncated sample, lower again. ``AutoClip(percentile=90, window=1000)`` fed only the
taken norms, skipping on stationary, healthy norms (:math:`|N(1, 0.1)|`), took 16% of
the first 3,000 steps, 8% of the last 1,000 of 30,000, and 11% overall. Every finite
statistic entering, it skips 9.5% to 10.8% of every block of 3,000
(``tests/lib/test_adaptive.py::test_skip_mode_cannot_ratchet``).

**Non-finite statistics never enter.** The sources append every norm, so that one NaN
makes every later percentile NaN for a window, turns an EMA into NaN for good, or makes a
σ-window skip every step until the NaN leaves it. Here ``update`` leaves the state the
same bit for bit where the statistic is NaN or infinite (or too large for ``dtype``), by
device-side selects (``torch.where``, never a multiplication by 0: ``NaN * 0`` is NaN).
(AutoClip's whole history may double its +inf padding on such a call, as on any other;
its values and count do not change.)

**No host reads.** The state lives in tensors on the statistic's device; ``threshold``
and ``update`` never read a value on the host nor branch in Python on one, so they do
not synchronise a GPU, and a step of ``threshold`` then ``update`` compiles with
``torch.compile(fullgraph=True)`` into one graph that does not recompile when the values
change. Build the policy on the statistic's device (``device=...``) so that its state does
not move inside the compiled region. The one exception, AutoClip's whole history
(``window=None``), grows, and its growth recompiles a few times; see :class:`AutoClip`.

**Cost.** A step of ``threshold`` then ``update`` is a few dozen kernels on 0-dim
tensors (and the window or history), whatever the model's size. Its median thread CPU
time on one CPU thread, as a ratio to one fused ``AdamW.step()`` of a 394K-parameter MLP
(``benchmarks/bench_adaptive.py``, three runs on a shared two-core machine, so the
ranges are wide): SigmaSkip 0.35-0.43, AutoClip with a window of 1000 0.46-0.67, ZClip
0.58-0.74, AutoClip's whole history 0.75-0.89 after 1,100 steps and 1.4-4.6 after
100,000 (its ``update`` is a pass over the history). Compiled by inductor (one run):
SigmaSkip 0.25, ZClip 0.29, the windowed AutoClip 0.74 (its sort remains).

:func:`agc_` is not a policy but a clipping function like :func:`gradlab.clip_grad_norm_`:
adaptive gradient clipping, unit by unit, relative to the weights.
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

#: Slots of AutoClip's whole history before its first doubling.
_HISTORY_START = 1024


# ------------------------------------------------------------------------ protocol


@runtime_checkable
class ThresholdPolicy(Protocol):
    """What :class:`gradlab.StepGuard` needs from an adaptive threshold.

    * ``threshold(stat)`` returns the threshold for this step's statistic, a 0-dim
      tensor on the statistic's device, and leaves the state's values as they are.
    * ``update(stat, taken)`` folds the step into the state. ``taken`` is a 0-dim bool
      tensor (or a bool): whether the optimizer took this step. Which statistics enter
      is the policy's choice and its docstring says it; a non-finite ``stat`` never
      enters, and then the state stays the same bit for bit.
    * ``state_dict()`` / ``load_state_dict()`` round-trip the state, so that a run
      resumed from a checkpoint gets the same thresholds bit for bit.

    Neither ``threshold`` nor ``update`` reads a tensor value on the host.
    """

    def threshold(self, stat: Tensor) -> Tensor: ...

    def update(self, stat: Tensor, taken: Tensor | bool) -> None: ...

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
        """The dtype in which the statistics are read and the thresholds returned."""
        return self._dtype

    def to(self, device: torch.device | str) -> Self:
        """Move the state to ``device`` (a copy once; the values do not change).

        Returns:
            Self: this policy.
        """
        self._state = {name: t.to(device) for name, t in self._state.items()}
        self._device = next(iter(self._state.values())).device
        return self

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The hyperparameters and a copy of every state tensor.

        Returns:
            dict: ``{"config": {...}, "state": {name: Tensor}}``.
        """
        return {
            "config": self._config(),
            "state": {name: t.detach().clone() for name, t in self._state.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state saved by ``state_dict()`` of an identically built policy.

        The tensors are copied into the existing ones (so that a compiled step that
        holds them does not recompile), whatever device they were saved from.

        Args:
            state_dict (Mapping): what ``state_dict()`` returned.

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
            if not isinstance(theirs, Tensor) or theirs.dtype != mine.dtype:
                raise ValueError(f"state_dict['state'][{name!r}] must be a {mine.dtype} tensor")
            if not self._shape_ok(name, mine, theirs):
                raise ValueError(
                    f"state_dict['state'][{name!r}] must be a {mine.dtype} tensor of shape "
                    f"{tuple(mine.shape)}"
                )
        with torch.no_grad():
            for name, mine in self._state.items():
                theirs = saved[name]
                if theirs.shape == mine.shape:
                    mine.copy_(theirs)
                else:  # only where _shape_ok allows it: a state that grows
                    self._state[name] = theirs.detach().to(self._device, copy=True)

    def _shape_ok(self, name: str, mine: Tensor, theirs: Tensor) -> bool:
        return theirs.shape == mine.shape

    # -- inputs
    def _prepare(self, stat: Tensor | float) -> Tensor:
        """The statistic as a 0-dim tensor of ``dtype``, on the state's device.

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

    @staticmethod
    def _taken(taken: Tensor | bool, x: Tensor) -> Tensor:
        """``taken`` checked, as a 0-dim bool tensor on ``x``'s device."""
        if isinstance(taken, bool):
            return torch.tensor(taken, device=x.device)
        if not isinstance(taken, Tensor) or taken.dtype != torch.bool:
            raise ValueError(f"taken must be a bool tensor or a bool, got {taken!r}")
        if taken.numel() != 1:
            raise ValueError(f"taken must hold one value, got shape {tuple(taken.shape)}")
        if taken.dim() != 0:
            taken = taken.reshape(())
        return taken if taken.device == x.device else taken.to(x.device)

    @staticmethod
    def _check_taken(taken: Tensor | bool) -> None:
        """``taken`` checked and not used: for a policy that every finite step enters."""
        if isinstance(taken, bool):
            return
        if not isinstance(taken, Tensor) or taken.dtype != torch.bool:
            raise ValueError(f"taken must be a bool tensor or a bool, got {taken!r}")
        if taken.numel() != 1:
            raise ValueError(f"taken must hold one value, got shape {tuple(taken.shape)}")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({args})"


def _finite(x: Tensor) -> Tensor:
    """0-dim bool: ``x`` is finite. ``|x| < inf`` (NaN compares false) is two kernels,
    ``torch.isfinite`` five."""
    return x.abs() < _INF


def _ring_write_(buffer: Tensor, count: Tensor, x: Tensor, ok: Tensor) -> None:
    """Put ``x`` in the ring ``buffer`` at ``count % len`` where ``ok``; else keep it.

    Written with index_put_ on a 1-element index, not ``buffer[i] = ...``: indexing
    with a 0-dim tensor reads the index on the host. Where ``ok`` is false the slot is
    rewritten with its own value, which keeps every bit.
    """
    slot = torch.remainder(count, buffer.numel()).reshape(1)
    old = buffer.gather(0, slot)
    buffer.index_put_((slot,), torch.where(ok, x.reshape(1), old))


def _set_(state: Tensor, value: Tensor) -> None:
    """``state.copy_(value)`` for a 0-dim ``state``, through a 1-element view. Under
    torch.compile (aot_eager and inductor, torch 2.13 on the CPU) a ``copy_`` into a
    0-dim float64 CPU tensor is silently dropped; into its view it is kept."""
    state.view(1).copy_(value.reshape(1))


def _count_up_(count: Tensor, ok: Tensor) -> None:
    _set_(count, torch.where(ok, count + 1, count))


class _Window(_Policy):
    """The last ``window`` statistics that entered, in a ring buffer, and their count.

    Subclasses set ``window`` before ``_Policy.__init__`` and ``_EMPTY``, the value of
    a slot that nothing has entered yet; :meth:`_enter_` is their ``update``.
    """

    window: int
    _EMPTY: float

    def _initial_state(self) -> dict[str, Tensor]:
        return {
            "values": torch.full((self.window,), self._EMPTY, dtype=self._dtype),
            # Statistics that ever entered; the filled slots are min(count, window).
            "count": torch.zeros((), dtype=torch.int64),
        }

    def _filled(self) -> Tensor:
        return self._state["count"].clamp(max=self.window)

    def _enter_(self, x: Tensor, ok: Tensor) -> None:
        """Append ``x`` to the window where ``ok``; else change no bit."""
        values, count = self._state["values"], self._state["count"]
        _ring_write_(values, count, x, ok)
        _count_up_(count, ok)


# ------------------------------------------------------------------------ AutoClip


class AutoClip(_Window):
    r"""AutoClip: the threshold is a percentile of the gradient norms seen so far.

    **The paper's rule** (``window=None``, the default). Seetharaman et al.'s
    Algorithm 1 appends each step's norm to the history :math:`G_h(t)`, then clips at
    its :math:`p`-th percentile, the current norm included. With
    :math:`x_{(0)} \le \dots \le x_{(n-1)}` the :math:`n` finite statistics so far,
    this step's included, sorted:

    .. math::
        r = \frac{p}{100}(n - 1), \qquad
        \tau = x_{(\lfloor r \rfloor)}
            + (r - \lfloor r \rfloor)\,\bigl(x_{(\lceil r \rceil)} - x_{(\lfloor r \rfloor)}\bigr),

    the linear interpolation of ``numpy.percentile``, which the authors' sample code
    (``autoclip.py``) calls on the whole list. :math:`p = 10` is the default, the
    paper's recommendation ("one can set p = 10 to get greatly improved performance",
    with Adam), and "if p = 10, then we know 90% of the gradients are typically being
    clipped". A norm equal to its own threshold (the first step's, say) is within, up
    to the rounding of the guard's comparison.

    **The windowed variant** (``window=w``): the rule of ``QuantileClip`` in the
    third-party ``autoclip`` package (``HesitantlyHuman/autoclip``), whose README calls
    its clippers "implementations (and variations)" of the paper. There
    :math:`x_{(i)}` are the last :math:`n = \min(N, w)` finite statistics *before* this
    step, and :math:`\tau = \infty` while there is none; the same bits as
    :func:`torch.quantile` on them, as the package computes it. The package's
    defaults, ``QuantileClip(quantile=0.9, history_length=1000)``, are
    ``AutoClip(percentile=90.0, window=1000)`` here, used with its
    ``global_threshold=True`` (one threshold for the total norm; its own default is
    one threshold per parameter tensor).

    **What enters:** every finite statistic, whether the step was taken or not, as in
    both sources (so that ``"skip"`` mode cannot ratchet the threshold down); ``taken``
    is not used. Differences from the sources, deliberate: a NaN or infinite norm does
    not enter (the sources append it, which makes ``numpy.percentile`` and
    :func:`torch.quantile` NaN while it is in the history).

    **Cost.** Windowed: ``threshold`` sorts the window, :math:`O(w \log w)`; memory
    :math:`w` values. Whole history: the history is kept sorted, padded with
    :math:`+\infty` in a buffer that doubles from 1024 slots when the number of
    ``update`` calls reaches its size, counted on the host (no read); ``threshold`` is
    a binary search and two gathers, :math:`O(\log N)`, and ``update`` inserts the norm
    with a pass over the buffer, :math:`O(N)` time and memory traffic per step after
    :math:`N` steps. Memory: at most :math:`2N` values of ``dtype`` (8 MB for a million
    float32 steps), plus one temporary of that size during ``update``.

    **torch.compile.** The windowed variant compiles into one graph that never
    recompiles. The whole history compiles with ``fullgraph=True`` too, but it is not
    one graph: the host-side call count changes at every call and the buffer's size at
    every doubling, so dynamo compiles again at the second call, at the first doubling
    and the call after it, and at the second doubling; from then on it treats both as
    symbolic. Five graphs in a run of any length, with torch 2.13
    (``tests/lib/test_adaptive_compile.py`` checks at most five, none after the second
    doubling); a loaded checkpoint of another size may add one.

    Args:
        percentile (float): :math:`p \in [0, 100]`. Default: 10.0, the paper's
            recommendation.
        window (int, optional): ``None`` for the paper's whole history, or how many of
            the most recent finite statistics the windowed variant keeps, at least 1.
            Default: None
        device (torch.device or str, optional): where the state starts; it moves to
            the statistic's device on first use. Default: None (the CPU)
        dtype (torch.dtype): ``torch.float32`` or ``torch.float64``, the dtype of the
            state and of the thresholds. Default: ``torch.float32``

    References:
        P. Seetharaman, G. Wichern, B. Pardo, J. Le Roux. *AutoClip: Adaptive
        gradient clipping for source separation networks.* IEEE MLSP 2020,
        arXiv:2007.14469; sample code ``autoclip.py`` at
        https://github.com/pseeth/autoclip.
        ``autoclip`` 0.2.1, ``autoclip.torch.QuantileClip``,
        https://github.com/HesitantlyHuman/autoclip (a third party's package).
    """

    _EMPTY = _INF  # an empty slot sorts after every finite statistic

    def __init__(
        self,
        *,
        percentile: float = 10.0,
        window: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.percentile = check_real("percentile", percentile, 0.0, 100.0)
        self.window = None if window is None else check_int("window", window, 1)  # type: ignore[assignment]
        self._quantile = self.percentile / 100
        # update() calls so far, on the host: an upper bound on the history's count,
        # which tells when the buffer must grow without reading the count.
        self._calls = 0
        super().__init__(device, dtype)

    def _initial_state(self) -> dict[str, Tensor]:
        if self.window is not None:
            return super()._initial_state()
        return {
            # Finite statistics in ascending order, then +inf in the free slots.
            "history": torch.full((_HISTORY_START,), _INF, dtype=self._dtype),
            "count": torch.zeros((), dtype=torch.int64),
        }

    def _config(self) -> dict[str, Any]:
        return {"percentile": self.percentile, "window": self.window}

    def threshold(self, stat: Tensor) -> Tensor:
        """The threshold of this step's statistic.

        Args:
            stat (Tensor or float): this step's statistic, one number.

        Returns:
            Tensor: 0-dim, of ``dtype``, on the statistic's device; ``inf`` while no
            finite statistic is in the history (whole history: this one included).

        .. note:: No host read.
        """
        x = self._prepare(stat)
        if self.window is None:
            return self._history_threshold(x)
        values = self._state["values"]
        filled = self._filled()
        ordered = values.sort().values
        # The rank q * (n - 1) in float64, as torch.quantile computes it from torch 2.14
        # on (2.13 rounds it to the values' dtype, which moves the weight by up to an ulp
        # of the rank: 20 float32 ulps of the threshold were seen).
        ranks = (filled - 1).clamp(min=0).to(torch.float64) * self._quantile
        below = ranks.floor()
        low = ordered.gather(0, below.to(torch.int64).reshape(1))
        high = ordered.gather(0, ranks.ceil().to(torch.int64).reshape(1))
        weight = (ranks - below).to(self._dtype).reshape(1)
        tau = torch.lerp(low, high, weight).reshape(())
        return torch.where(filled > 0, tau, _INF)

    def _history_threshold(self, x: Tensor) -> Tensor:
        """The percentile of the sorted history with ``x`` inserted, if finite."""
        history, count = self._state["history"], self._state["count"]
        finite = _finite(x)
        size = count + finite.to(torch.int64)
        # The rank in float64 whatever the dtype: float32 would misplace it by more
        # than one slot beyond about 2**24 / 100 steps.
        ranks = (size - 1).clamp(min=0).to(torch.float64) * self._quantile
        below = ranks.floor()
        weight = (ranks - below).to(self._dtype)
        # Where x would go: every order statistic of history + [x] is x or a history slot.
        where_x = torch.searchsorted(history, torch.where(finite, x, _INF).reshape(1)).reshape(())

        def order_statistic(k: Tensor) -> Tensor:
            slot = torch.where(k > where_x, k - 1, k)
            from_history = history.gather(0, slot.reshape(1)).reshape(())
            return torch.where(finite & (k == where_x), x, from_history)

        low = order_statistic(below.to(torch.int64))
        high = order_statistic(ranks.ceil().to(torch.int64))
        return torch.where(size > 0, torch.lerp(low, high, weight), _INF)

    def update(self, stat: Tensor, taken: Tensor | bool) -> None:
        """Add a finite ``stat`` to the history, whether the step was taken or not.

        Args:
            stat (Tensor or float): this step's statistic, one number.
            taken (Tensor or bool): whether the optimizer took the step; checked, not
                used.

        .. note:: No host read. The whole history grows on the host's count of calls.
        """
        x = self._prepare(stat)
        self._check_taken(taken)
        ok = _finite(x)
        if self.window is not None:
            self._enter_(x, ok)
            return
        if self._calls >= self._state["history"].numel():
            history = self._state["history"]
            self._state["history"] = torch.cat([history, torch.full_like(history, _INF)])
        self._calls += 1
        history, count = self._state["history"], self._state["count"]
        # Where x goes; a non-finite x "goes" to the first empty slot, index count.
        where_x = torch.searchsorted(history, torch.where(ok, x, _INF).reshape(1))
        slots = torch.arange(history.numel(), device=history.device)
        # Insert x: the slots after where_x take their left neighbour, and the last, an
        # empty +inf slot (count < calls <= size), falls off. Not ok: nothing moves, and
        # the slot at where_x is rewritten with its own value, which keeps every bit.
        history.copy_(torch.where(ok & (slots > where_x), history.roll(1), history))
        kept = history.gather(0, where_x)
        history.index_put_((where_x,), torch.where(ok, x.reshape(1), kept))
        _count_up_(count, ok)

    def _shape_ok(self, name: str, mine: Tensor, theirs: Tensor) -> bool:
        if self.window is None and name == "history":
            return theirs.dim() == 1 and theirs.numel() >= 1
        return super()._shape_ok(name, mine, theirs)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state saved by ``state_dict()`` of an identically built policy.

        The whole history is taken at its saved size (a compiled step recompiles if the
        size differs); a window is copied into the existing tensors.

        Args:
            state_dict (Mapping): what ``state_dict()`` returned.

        Raises:
            ValueError: the hyperparameters differ, or a tensor is missing, has another
                dtype or shape, or the history has fewer slots than its count.

        .. note:: The whole history reads its count on the host, once.
        """
        super().load_state_dict(state_dict)
        if self.window is None:
            count = int(self._state["count"])
            if not 0 <= count <= self._state["history"].numel():
                raise ValueError(
                    f"state_dict['state']['count'] is {count}, but the history has "
                    f"{self._state['history'].numel()} slots"
                )
            self._calls = count


# --------------------------------------------------------------------------- ZClip


class ZClip(_Policy):
    r"""ZClip: clip where the z-score of the statistic against its EMA is too high.

    State: an exponential moving mean :math:`\mu` and variance :math:`\sigma^2`.
    With :math:`z = (x - \mu) / (\sigma + \varepsilon)` and :math:`z_t` = ``z_thresh``,
    the threshold ("adaptive scaling", the reference's default) is

    .. math::
        \tau = \begin{cases}
            \mu + z_t^2\,\sigma / z & z > z_t, \\
            \infty & \text{otherwise,}
        \end{cases}

    the reference's ``mean + z_thresh * std / (z / z_thresh)``: a spike is clipped
    further below :math:`\mu + z_t\sigma` the larger it is. ``max_norm``, if given,
    caps :math:`\tau` at every step, warm-up included, as the reference's
    ``max_grad_norm`` does. After the warm-up, each finite statistic updates the EMA
    with its clipped value :math:`\hat x = \min(x, \tau)` (:math:`\tau` before the cap, as the
    reference feeds back its ``clip_val``), the new :math:`\mu` entering the variance:

    .. math::
        \mu \leftarrow \alpha\mu + (1 - \alpha)\hat x, \qquad
        \sigma^2 \leftarrow \alpha\sigma^2 + (1 - \alpha)(\hat x - \mu)^2 .

    Warm-up: the first ``warmup`` finite statistics are collected as they are, and
    :math:`\mu, \sigma^2` are set to their mean and population variance. Until then
    the threshold is ``max_norm`` (:math:`\infty` without one).

    **What enters:** every finite statistic, whether the step was taken or not, as in
    the reference (whose ``skip_update_on_spike`` is off by default); ``taken`` is not
    used. A skipped spike enters clipped, below :math:`\mu + z_t\sigma`, so a skip
    cannot ratchet the threshold.

    **float64.** The warm-up buffer, :math:`\mu` and :math:`\sigma^2` are kept in
    float64 whatever ``dtype``, as the reference keeps them in Python floats: in float32
    one finite norm above about :math:`1.8 \times 10^{19}` would make
    :math:`\sigma^2` infinite, and ZClip would never clip again. The threshold is
    rounded to ``dtype`` (a device without float64, such as MPS, cannot hold the state).

    Differences from the reference implementation (``bluorion-com/ZClip``), deliberate:
    there a NaN or infinite norm enters the warm-up buffer or the EMA like any other and
    poisons it for the rest of the run, and every norm is read on the host
    (``.item()``); here non-finite statistics are left out and nothing is read on the
    host. ``max_norm`` defaults to ``None``, where the reference's ``max_grad_norm``
    defaults to 1.0 (which, on a model whose norms are about 6, clips every step). The
    reference's ``clip_factor``, ``skip_update_on_spike`` and its ``"mean"`` and
    ``"percentile"`` options are not provided. ``eps`` is absolute, as there: for
    statistics whose :math:`\sigma` is not far above ``eps`` (gradient norms below about
    1e-4 with the default), it shrinks the z-scores and only large spikes are clipped;
    pass an ``eps`` well below the statistics' scale (0 is allowed).

    Args:
        alpha (float): :math:`\alpha \in [0, 1)`, the EMA's memory. Default: 0.97
        z_thresh (float): :math:`z_t > 0`, finite. Default: 2.5
        warmup (int): how many finite statistics initialise the EMA, at least 1.
            Default: 25
        eps (float): :math:`\varepsilon \ge 0` in the z-score's denominator.
            Default: 1e-6
        max_norm (float, optional): a cap on the threshold at every step, ``>= 0``.
            Default: None (no cap; the reference's default is 1.0)
        device (torch.device or str, optional): where the state starts; it follows the
            statistic's device. Default: None (the CPU)
        dtype (torch.dtype): ``torch.float32`` or ``torch.float64``, the dtype in which
            the statistic is read and the threshold returned. Default: ``torch.float32``

    References:
        A. Kumar, L. Owen, N. R. Chowdhury, F. Güra. *ZClip: Adaptive spike
        mitigation for LLM pre-training.* arXiv:2504.02507, 2025; reference code
        ``zclip/zclip.py`` at https://github.com/bluorion-com/ZClip.
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
        f64 = torch.float64
        return {
            "warm": torch.zeros((self.warmup,), dtype=f64),
            "count": torch.zeros((), dtype=torch.int64),  # finite statistics ever
            "mean": torch.zeros((), dtype=f64),
            "var": torch.zeros((), dtype=f64),
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
        """The post-warm-up threshold of float64 ``x``: μ + z_t²σ/z where z > z_t, else inf."""
        mean, std = self._state["mean"], self._state["var"].sqrt()
        z = (x - mean) / (std + self.eps)
        over = z > self.z_thresh
        # z > z_t > 0 wherever the quotient is used; elsewhere divide by 1, not by 0.
        scaled = mean + (self.z_thresh**2) * std / torch.where(over, z, 1.0)
        return torch.where(over, scaled, _INF)

    def threshold(self, stat: Tensor) -> Tensor:
        """The threshold of this step's statistic.

        Args:
            stat (Tensor or float): this step's statistic, one number.

        Returns:
            Tensor: 0-dim, of ``dtype``, on the statistic's device: the adaptive
            threshold (``inf`` where the z-score is within ``z_thresh``), capped at
            ``max_norm``; during warm-up ``max_norm`` or ``inf``.

        .. note:: No host read.
        """
        x = self._prepare(stat).to(torch.float64)
        warming = self._state["count"] < self.warmup
        tau = torch.where(warming, _INF, self._adaptive(x))
        if self.max_norm is not None:
            tau = tau.clamp(max=self.max_norm)
        return tau.to(self._dtype)

    def update(self, stat: Tensor, taken: Tensor | bool) -> None:
        """Collect a finite ``stat`` during warm-up, then update the EMA with its clipped
        value, whether the step was taken or not.

        Args:
            stat (Tensor or float): this step's statistic, one number.
            taken (Tensor or bool): whether the optimizer took the step; checked, not
                used.

        .. note:: No host read.
        """
        x_read = self._prepare(stat)
        self._check_taken(taken)
        ok = _finite(x_read)  # in dtype: a float64 statistic too large for float32 is inf
        x = x_read.to(torch.float64)
        warm, count = self._state["warm"], self._state["count"]
        mean, var = self._state["mean"], self._state["var"]
        warming = count < self.warmup
        # Warm-up: collect x; the step that fills the buffer initialises the EMA.
        _ring_write_(warm, count, x, ok & warming)
        completes = ok & (count == self.warmup - 1)
        warm_mean = warm.mean()
        warm_var = (warm - warm_mean).square().mean()
        # After warm-up: the EMA update with x clipped at its own (uncapped) threshold.
        clipped = torch.minimum(x, self._adaptive(x))
        ema_mean = self.alpha * mean + (1 - self.alpha) * clipped
        ema_var = self.alpha * var + (1 - self.alpha) * (clipped - ema_mean).square()
        moves = ok & ~warming
        mean_new = torch.where(completes, warm_mean, torch.where(moves, ema_mean, mean))
        var_new = torch.where(completes, warm_var, torch.where(moves, ema_var, var))
        _set_(mean, mean_new)
        _set_(var, var_new)
        _count_up_(count, ok)


# ----------------------------------------------------------------------- SigmaSkip


_STEPS = ("all", "taken")


class SigmaSkip(_Window):
    r"""The σ rule of OLMo-core: a statistic far above the recent ones is over.

    With :math:`x_1, \dots, x_n` the last :math:`n = \min(N, \text{window})` statistics
    in the window before this step and :math:`k` the ``k``:

    .. math::
        \bar x = \frac1n \sum_i x_i, \qquad
        s = \sqrt{\frac{1}{n - 1} \sum_i (x_i - \bar x)^2}, \qquad
        \tau = \begin{cases} \bar x + k s & n \ge \text{min\_count}, \\
                             \infty & \text{otherwise,} \end{cases}

    :math:`s` being the sample standard deviation of :func:`torch.std_mean`. Meant for
    ``StepGuard(mode="skip")``: OLMo-core's ``SkipStepOptimizer`` skips a step whose
    loss *or* gradient norm is over, each against its own window, which is
    ``StepGuard(mode="skip", threshold=SigmaSkip(), loss_threshold=SigmaSkip())``.

    **What enters** (``steps``):

    * ``"all"`` (the default, OLMo-core's): every finite statistic, whether the step
      was taken or not. OLMo-core's ``latest_loss`` and ``latest_grad_norm`` setters
      append every step's value. A spike widens the window that follows it, but a new
      level of the statistic enters and is learnt within a few steps: after a shift of
      the norm from 1 to 3, the fourth step after it is taken
      (``test_sigma_all_resumes_after_a_level_shift_and_taken_locks_out`` in
      ``tests/lib/test_adaptive.py``), where ``"taken"`` skips all 300 that follow.
    * ``"taken"``: only the finite statistics of taken steps, gradlab's earlier
      variant. A spike never widens the window, but a level shift above
      :math:`\bar x + ks` never enters either, and every later step is skipped: the
      rule locks out until something else (``max_consecutive_skips``) intervenes.

    The default is OLMo-core's because it is the published rule, the one a reader of
    OLMo 2 expects, and because it cannot lock out.

    Differences from OLMo-core, deliberate: a NaN or infinite statistic does not enter
    (OLMo-core appends it, and then skips every step until it leaves the window); the
    test is :math:`x \le \bar x + ks` where OLMo-core tests
    :math:`x - \bar x \le ks` (the same up to rounding at the boundary), and both the
    statistics and the comparison are in ``dtype`` (OLMo-core's are in the loss's and
    norm's dtype, float32 mostly). OLMo-core starts once its list, the current step
    included, holds ``max(2, rolling_interval_length // 2)`` values: the default
    ``min_count`` does the same, counting the earlier values only (63 for a window of
    128), and at least 2 (OLMo-core's rule would take the standard deviation of one
    value for a window below 6, which is NaN, and skip).

    Args:
        k (float): :math:`k \ge 0`, finite, in standard deviations; OLMo-core's
            ``sigma_factor``. Default: 6.0
        window (int): how many of the most recent statistics that entered are kept, at
            least 2; OLMo-core's ``rolling_interval_length``. Default: 128
        min_count (int, optional): below this many values in the window, no threshold;
            ``2 <= min_count <= window``. Default: None, OLMo-core's start:
            ``max(2, window // 2 - 1)``
        steps (str): ``"all"`` or ``"taken"``, what enters; see above. Default: ``"all"``
        device (torch.device or str, optional): where the state starts; it follows the
            statistic's device. Default: None (the CPU)
        dtype (torch.dtype): ``torch.float32`` or ``torch.float64``, the dtype of the
            state and of the thresholds. Default: ``torch.float32``

    References:
        Allen Institute for AI. OLMo-core, ``olmo_core.optim.SkipStepOptimizer``
        (``src/olmo_core/optim/skip_step_optimizer.py``),
        https://github.com/allenai/OLMo-core; Team OLMo. *2 OLMo 2 Furious.*
        arXiv:2501.00656, 2025.
    """

    _EMPTY = 0.0  # masked out: any value does

    def __init__(
        self,
        k: float = 6.0,
        window: int = 128,
        min_count: int | None = None,
        *,
        steps: str = "all",
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.k = check_real("k", k, 0.0)
        if math.isinf(self.k):
            raise ValueError("k must be finite, got inf")
        self.window = check_int("window", window, 2)
        if min_count is None:
            min_count = max(2, self.window // 2 - 1)
        self.min_count = check_int("min_count", min_count, 2)
        if self.min_count > self.window:
            raise ValueError(f"min_count must be <= window ({self.window}), got {min_count}")
        if steps not in _STEPS:
            raise ValueError(f"steps must be 'all' or 'taken', got {steps!r}")
        self.steps = steps
        super().__init__(device, dtype)

    def _config(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "window": self.window,
            "min_count": self.min_count,
            "steps": self.steps,
        }

    def threshold(self, stat: Tensor) -> Tensor:
        """The threshold of this step's statistic, from the window before it.

        Args:
            stat (Tensor or float): this step's statistic, one number.

        Returns:
            Tensor: 0-dim, of ``dtype``, on the statistic's device: mean + k·std of
            the window, ``inf`` below ``min_count`` values.

        .. note:: No host read.
        """
        x = self._prepare(stat)
        values = self._state["values"]
        filled = self._filled()
        valid = torch.arange(self.window, device=x.device) < filled
        # Clamped denominators keep the unused branch free of 0/0 before min_count.
        n = filled.clamp(min=2).to(self._dtype)
        mean = torch.where(valid, values, 0.0).sum() / n
        var = torch.where(valid, (values - mean).square(), 0.0).sum() / (n - 1)
        tau = mean + self.k * var.sqrt()
        return torch.where(filled >= self.min_count, tau, _INF)

    def update(self, stat: Tensor, taken: Tensor | bool) -> None:
        """Append a finite ``stat`` to the window: every one (``steps="all"``) or those
        of taken steps (``steps="taken"``).

        Args:
            stat (Tensor or float): this step's statistic, one number.
            taken (Tensor or bool): whether the optimizer took the step.

        .. note:: No host read.
        """
        x = self._prepare(stat)
        ok = _finite(x)
        if self.steps == "taken":
            ok = ok & self._taken(taken, x)
        else:
            self._check_taken(taken)
        self._enter_(x, ok)


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
        parameters (Tensor or Iterable[Tensor]): a tensor or tensors whose ``.grad``
            is clipped in place; tensors without a gradient are skipped.
        clip_factor (float): :math:`\lambda > 0`, finite. The paper uses 0.01 at batch
            size 4096; it finds that larger batches need smaller values. Default: 0.01
        eps (float): the smallest weight norm a unit is measured against, ``> 0``,
            finite. Default: 1e-3
        exclude (Tensor or Iterable[Tensor]): parameters (compared by identity) to leave
            alone, typically the final classifier layer, which the paper does not clip.
            Default: ``()``
        foreach (bool, optional): ``None`` picks the foreach kernels where the device
            supports them; ``True`` demands them (RuntimeError where unsupported);
            ``False`` loops. Default: None

    Returns:
        Tensor: how many units were clipped, 0-dim int64 on the first gradient's device
        (``tensor(0)`` when there is none): the clip rate to log.

    Raises:
        ValueError: a bad argument, named, before any gradient changes.

    .. note:: No host read.

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
