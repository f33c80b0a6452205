r"""Flat gradients: one contiguous buffer per (device, dtype), each ``.grad`` a view into it.

**Why the cost grows with the number of tensors.** :func:`gradlab.get_total_norm`,
:func:`gradlab.clip_grad_norm_` and the other functions (and :mod:`torch.nn.utils`) act
on a list of gradient tensors. Each tensor costs a fixed amount on top of its entries:
on a CPU, torch's ``_foreach`` kernels are a C++ loop that dispatches one kernel per
tensor and allocates one 0-dim result per tensor for a norm, so ``_foreach_norm`` and
``_foreach_mul_`` remove the Python loop but not the per-tensor launch and allocation;
the per-tensor norms are then stacked and reduced once more. On a GPU the
multi-tensor-apply kernels pack several tensors into one launch, but no more than a
fixed number of tensors and of 65,536-element chunks per launch
(``aten/src/ATen/native/cuda/MultiTensorApply.cuh``: 110 tensors and 320 blocks for one
list with 4 KB kernel arguments), and the norm still makes one output per tensor. With
thousands of small tensors (the biases and LayerNorm weights of a deep transformer) the
fixed cost dominates: on one CPU thread, at a fixed 1M floats, the review
``performance-review-2026-12-b.md`` measured about 2 µs per tensor for the norm, 3 µs for
clip and 3.6 µs for ignore, so that 3,000 tensors cost 54x, 82x and 100x one
:func:`torch.linalg.vector_norm` over a single buffer of the same size
(``benchmarks/bench_flat.py`` measures it again, beside the fix).

**The fix** is the one Megatron-LM (``megatron/core/distributed/param_and_grad_buffer.py``),
DeepSpeed (``contiguous_gradients``) and DDP (``gradient_as_bucket_view=True``) use: keep
the gradients in one contiguous buffer and let each ``param.grad`` be a view into it.
``backward`` accumulates into the views in place (autograd's ``AccumulateGrad`` adds
into an existing ``.grad``), optimizers step on them as on any gradient, and a norm, a
rescaling, a zeroing or a clamp of all of them is one kernel over the buffer, whatever
the number of tensors::

    flat = gradlab.flat.flatten_grads(model)  # the one line, after model.to(device)
    for x, y in data:
        loss_fn(model(x), y).backward()
        gradlab.clip_grad_norm_(flat, 1.0)       # one norm and one multiply per buffer
        optimizer.step()
        optimizer.zero_grad()                    # set_to_none=True is handled (FlatGrads)

Every function of :mod:`gradlab.clip` takes the :class:`FlatGrads` object in place of
``parameters`` (or ``tensors``) and then reads no parameter at all: a check of two
parameters per buffer, then one kernel per buffer. Given a plain list of parameters or
gradients, they find the views of a common buffer themselves (:func:`coalesce`), which
also covers DDP's bucket views with no :class:`FlatGrads` at all, but that walk costs a
few hundred nanoseconds per tensor in Python. Norms over a buffer differ from the
per-tensor ones by summation order only; a rescaling, zeroing or clamp gives the same
bits as the per-tensor path, element for element.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from gradlab._common import PLAIN_TYPES, check_flag

__all__ = ["FlatGrads", "FlatRuns", "coalesce", "flat_grads_of", "flatten_grads"]

#: Each flattened parameter -> its live FlatGrads (weakly on both sides: a FlatGrads is
#: kept alive by its hooks, which its parameters hold, or by the caller).
_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: Optimizers and modules looked up by flat_grads_of -> (weakref to the FlatGrads or None,
#: the number of param groups then, the _GENERATION then).
_LOOKUPS: weakref.WeakKeyDictionary[Any, tuple[Any, int, int]] = weakref.WeakKeyDictionary()
#: Bumped whenever a FlatGrads is made or retired, so that cached lookups are redone.
_GENERATION = [0]


def _dense_strides(t: Tensor) -> tuple[int, ...] | None:
    """``t``'s strides if its entries fill ``t.numel()`` consecutive slots (a permuted
    contiguous layout, channels_last say); None if it has gaps or overlaps."""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        size = t.size(d)
        if size != 1 and t.stride(d) != expected:
            return None
        expected *= size
    return tuple(t.stride())


def _covers_its_span(t: Tensor) -> bool:
    return t.is_contiguous() or _dense_strides(t) is not None


class FlatGrads:
    r"""The gradients of some parameters, held in one contiguous buffer per (device, dtype).

    Each parameter's ``.grad`` becomes a view of its region of the buffer (with the
    parameter's own strides, as autograd would give it): an existing gradient is copied
    into the view, a missing one is zeros. Then:

    * ``backward`` accumulates into the views in place, and
      ``zero_grad(set_to_none=False)`` zeroes them in place: both keep the views;
    * optimizers (fused, foreach or for-loop; every :mod:`torch.optim` optimizer) step on
      them unchanged, and ``state_dict`` / ``load_state_dict`` of the model and the
      optimizer are unchanged (neither holds gradients);
    * passing this object to any :mod:`gradlab.clip` function acts on the buffers: one
      kernel per buffer for the norm and one for the rescaling, zeroing or clamp;
    * there is no second copy of the gradients: the buffers are their only storage.

    ``zero_grad(set_to_none=True)``, torch's default, drops the views. With ``rebind=True``
    a post-accumulate-grad hook on each parameter puts the next backward's fresh gradient
    back into its view (one copy of that gradient, right after autograd made it, so that
    never more than one tensor's gradient is held twice), and at the end of that backward
    the parameters that got no gradient are bound to their zeroed region: in flat mode
    every parameter always has a gradient, zeros where none flowed, as after
    ``zero_grad(set_to_none=False)``. Costs: one Python call per parameter per backward
    while the views are in place, and one copy kernel per parameter in a backward after
    ``set_to_none=True`` (``benchmarks/bench_flat.py`` measures both).
    ``optimizer.zero_grad(set_to_none=False)`` or :meth:`zero_grad` (one kernel per
    buffer) avoid the copies. With ``rebind=False`` there is no hook, and the functions
    that take this object raise a ValueError naming the fix once the views are gone.

    Parameters with ``requires_grad=False`` are left out (they get no gradient and take
    no room). What is checked at each use, in O(1): the first and last parameter of each
    buffer still hold their views, at the buffer's address (``set_to_none``, an
    assignment to ``.grad``, or ``model.to(...)`` after flattening fail it), and, for a
    :class:`FlatGrads` made from an optimizer, that no param group was added. What is
    not: a ``.grad`` assigned by hand to a parameter in the middle of a buffer (it is
    left out until the next backward rebinds it, with ``rebind=True``), a parameter
    unfrozen after flattening (it gets an ordinary gradient, outside the buffer), and
    ``backward(create_graph=True)``, which autograd answers with an out-of-place
    gradient that a view cannot hold (the rebind hook raises a RuntimeError).

    Args:
        params (Iterable[Tensor]): the parameters (leaf tensors); those that do not
            require a gradient are left out, and a parameter given twice counts once.
        rebind (bool): keep the views across ``zero_grad(set_to_none=True)`` with a
            post-accumulate-grad hook per parameter. Default: True

    Raises:
        ValueError: a tensor that is not a leaf, a sparse or DTensor parameter, a
            parameter already in another live :class:`FlatGrads` that this one does not
            wholly contain; checked before any gradient changes.

    .. note::
        Making it copies the existing gradients (one pass, no host read). Using it reads
        nothing on the host.

    Use :func:`flatten_grads` for a model, an optimizer or DDP.
    """

    def __init__(self, params: Iterable[Tensor], *, rebind: bool = True) -> None:
        check_flag("rebind", rebind)
        self._rebind = rebind
        self._params = _unique_leaves(params)
        self._hooks: list[RemovableHandle] = []
        self._alive = True
        self._restore_queued = False
        self._optimizer: weakref.ref | None = None
        self._groups_at_start = 0
        self._ddp: Any = None
        _take_over(self._params)
        self._views: list[Tensor] = []
        self._buffers: list[Tensor] = []
        self._allocate()
        self._runs = list(self._buffers)
        self._heads = self._heads_of(self._runs_members)
        for p in self._params:
            _OWNER[p] = weakref.ref(self)
        self._slot_keys = [id(v) for v in self._views]
        self._me = weakref.ref(self)
        _SLOTS.update((id(v), (v, self._me, i)) for i, v in enumerate(self._views))
        weakref.finalize(self, _drop_slots, self._slot_keys, self._me)
        if rebind:
            self._hooks.extend(
                p.register_post_accumulate_grad_hook(_rebind_hook(self, i, v))
                for i, (p, v) in enumerate(zip(self._params, self._views, strict=True))
            )
        _GENERATION[0] += 1

    # ------------------------------------------------------------------ building

    def _allocate(self) -> None:
        by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self._params):
            by_key.setdefault((p.device, p.dtype), []).append(i)
        self._views = [torch.empty(0)] * len(self._params)
        self._runs_members: list[list[int]] = []
        #: index -> (its buffer's number, its rank in that buffer)
        self._where: list[tuple[int, int]] = [(0, 0)] * len(self._params)
        self._offsets: list[list[int]] = []  # per buffer: the start of each rank, and the end
        with torch.no_grad():
            for (device, dtype), members in by_key.items():
                buffer = torch.zeros(
                    sum(self._params[i].numel() for i in members), dtype=dtype, device=device
                )
                offset, starts = 0, []
                for rank, i in enumerate(members):
                    p = self._params[i]
                    view = _region(buffer, offset, p)
                    if p.grad is not None:
                        view.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
                    self._views[i] = view
                    self._where[i] = (len(self._buffers), rank)
                    starts.append(offset)
                    offset += p.numel()
                self._offsets.append([*starts, offset])
                self._buffers.append(buffer)
                self._runs_members.append(members)
            for p, view in zip(self._params, self._views, strict=True):
                p.grad = view

    def _heads_of(self, members: list[list[int]]) -> list[tuple[Tensor, Tensor, int]]:
        """(parameter, its view, the view's address) of the first and last of each run."""
        heads = []
        for run in members:
            for i in {run[0], run[-1]}:
                heads.append((self._params[i], self._views[i], self._views[i].data_ptr()))
        return heads

    def _slices(self, buffer_no: int, ranks: list[int]) -> list[Tensor]:
        """The views of buffer ``buffer_no`` covering the regions of sorted ``ranks``,
        one per run of consecutive ranks."""
        offsets, buffer = self._offsets[buffer_no], self._buffers[buffer_no]
        out, first = [], ranks[0]
        for previous, rank in zip(ranks, [*ranks[1:], -1], strict=True):
            if rank != previous + 1:
                out.append(_slice(buffer, offsets[first], offsets[previous + 1]))
                first = rank
        return out

    # ---------------------------------------------------------------- properties

    @property
    def params(self) -> tuple[Tensor, ...]:
        """The flattened parameters, in buffer order within each buffer."""
        return tuple(self._params)

    @property
    def buffers(self) -> tuple[Tensor, ...]:
        """The 1-D buffers that hold the gradients, one per (device, dtype) (for DDP, the
        runs of its buckets that hold this model's gradients)."""
        self._check_live()
        return tuple(self._runs)

    @property
    def numel(self) -> int:
        """How many gradient entries the buffers hold."""
        return sum(r.numel() for r in self._runs)

    def __len__(self) -> int:
        return len(self._params)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{r.numel()} x {r.dtype} on {r.device}" for r in self._runs)
        state = "" if self._alive else ", removed"
        mode = "DDP buckets" if self._ddp is not None else f"rebind={self._rebind}"
        return f"FlatGrads({len(self._params)} parameters: {kinds}; {mode}{state})"

    # ------------------------------------------------------------------------ use

    def grads(self) -> list[Tensor]:
        """The buffers, after the O(1) checks: what the :mod:`gradlab.clip` functions use.

        Returns:
            list[Tensor]: the 1-D buffers (a new list; the tensors are the buffers).

        Raises:
            ValueError: the views are gone (``set_to_none=True`` with ``rebind=False``, or
                no backward since it; ``.grad`` assigned; the model moved), the object was
                removed, or a param group was added to its optimizer.

        .. note::
            No host read.
        """
        self._check_live()
        return FlatRuns(self._runs)

    def _check_live(self) -> None:
        if not self._alive:
            raise ValueError(
                "this FlatGrads was removed (flat.remove(), or flatten_grads made another "
                "for its parameters): use the new one, or gradlab.flat.flatten_grads(...) again"
            )
        if self._optimizer is not None:
            optimizer = self._optimizer()
            if optimizer is not None and len(optimizer.param_groups) != self._groups_at_start:
                raise ValueError(
                    "a param group was added to the optimizer (add_param_group) after "
                    "flatten_grads(optimizer): "
                    "its parameters are not in the flat buffer. Call "
                    "gradlab.flat.flatten_grads(optimizer) again (it keeps the gradients' values)"
                )
        compiling = torch.compiler.is_compiling()
        for param, view, address in self._heads:
            if param.grad is not view or (not compiling and view.data_ptr() != address):
                if self._ddp is not None:
                    self._adopt()
                    return
                raise ValueError(self._lost_message(param, view))

    def _lost_message(self, param: Tensor, view: Tensor) -> str:
        grad = param.grad
        if (param.dtype, param.device) != (view.dtype, view.device):
            what = "the model was moved or cast after flatten_grads"
        elif grad is view:
            what = "the model was moved or cast after flatten_grads (.grad's storage changed)"
        elif grad is None:
            what = "zero_grad(set_to_none=True) (torch's default) set .grad to None"
        else:
            what = (
                ".grad is a new tensor: zero_grad(set_to_none=True) (torch's default) and a "
                "backward since, or an assignment to .grad, replaced the view"
            )
        fix = (
            "Run a backward first (the rebind hooks put the gradients back) or call "
            "flat.zero_grad()."
            if self._rebind
            else "Use optimizer.zero_grad(set_to_none=False) or flat.zero_grad(), or "
            "gradlab.flat.flatten_grads(..., rebind=True), which puts each new gradient back."
        )
        if "moved" in what:
            fix = "Call gradlab.flat.flatten_grads(...) again after model.to(...)."
        return f"the gradients are no longer views of the flat buffer: {what}. {fix}"

    def zero_grad(self) -> None:
        """Zero every gradient in place, one kernel per buffer, and put back lost views.

        The fast ``zero_grad`` of flat mode: ``optimizer.zero_grad(set_to_none=False)``
        gives the same zeros with one kernel per tensor. A parameter whose ``.grad`` is
        not its view (``set_to_none=True``, an assignment) is bound to it again (one
        identity check per parameter finds them).

        Returns:
            None

        .. note::
            No host read.
        """
        if not self._alive:
            self._check_live()
        with torch.no_grad():
            for run in self._runs:
                run.zero_()
        if self._ddp is not None:
            return
        for param, view in zip(self._params, self._views, strict=True):
            if param.grad is not view:
                _check_same_place(param, view)
                param.grad = view

    def remove(self) -> None:
        """Remove the hooks and forget the parameters; the gradients stay as they are.

        Afterwards the gradients are ordinary tensors (views of a buffer that lives as
        long as they do), and this object refuses to be used.

        Returns:
            None

        .. note::
            No host read.
        """
        if not self._alive:
            return
        self._alive = False
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._ddp is None:
            _drop_slots(self._slot_keys, self._me)
        for p in self._params:
            ref = _OWNER.get(p)
            if ref is not None and ref() is self:
                del _OWNER[p]
        _GENERATION[0] += 1

    # ------------------------------------------------------------------ rebinding

    def _rebind_one(self, index: int, param: Tensor, view: Tensor) -> None:
        """Put the gradient autograd just made for ``param`` into its view (rebind=True)."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                "FlatGrads cannot keep a gradient of backward(create_graph=True): autograd "
                "makes it out of place, as a differentiable tensor, which a view of the flat "
                "buffer cannot hold. Call flat.remove() before a double backward, or use "
                "torch.autograd.grad for the higher-order part."
            )
        grad = param.grad
        if grad is None:
            return
        if grad._base is not None and grad._base is not view._base:
            raise RuntimeError(
                f"parameter {index}'s .grad is now a view of another buffer (DDP's "
                "gradient_as_bucket_view?): call gradlab.flat.flatten_grads on the "
                "DistributedDataParallel module, not on the module inside it"
            )
        _check_same_place(param, view)
        view.copy_(grad.to_dense() if grad.is_sparse else grad)
        param.grad = view
        if not self._restore_queued:
            self._restore_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._restore)

    def _restore(self) -> None:
        """End of a backward in which views were lost: bind every parameter again."""
        self._restore_queued = False
        with torch.no_grad():
            for param, view in zip(self._params, self._views, strict=True):
                grad = param.grad
                if grad is view:
                    continue
                if grad is None:
                    view.zero_()
                else:
                    _check_same_place(param, view)
                    view.copy_(grad.to_dense() if grad.is_sparse else grad)
                param.grad = view

    # ------------------------------------------------------------------------ DDP

    @classmethod
    def _of_ddp(cls, ddp: Any) -> FlatGrads:
        """A FlatGrads over DDP's own buckets (gradient_as_bucket_view=True): no copy."""
        self = cls.__new__(cls)
        self._rebind = False
        self._params = _unique_leaves(ddp.parameters())
        self._hooks = []
        self._alive = True
        self._restore_queued = False
        self._optimizer = None
        self._groups_at_start = 0
        self._ddp = weakref.ref(ddp)
        self._views, self._buffers, self._runs, self._heads = [], [], [], []
        _take_over(self._params)
        for p in self._params:
            _OWNER[p] = weakref.ref(self)
        _GENERATION[0] += 1
        self._adopt()
        return self

    def _adopt(self) -> None:
        """Read where DDP put the gradients now (its buckets are rebuilt after the first
        iteration): the runs of adjacent bucket views, and their heads."""
        grads = [p.grad for p in self._params]
        present = [i for i, g in enumerate(grads) if g is not None]
        runs, members = _runs_of([grads[i] for i in present])  # type: ignore[misc]
        if runs is None:
            raise ValueError(
                "DDP's gradients are not views of its buckets (gradient_as_bucket_view=True "
                "is needed, and no .grad assigned by hand)"
            )
        self._views = [g if g is not None else torch.empty(0) for g in grads]
        self._runs = runs
        self._heads = self._heads_of([[present[j] for j in run] for run in members])
        # A parameter that has no gradient yet (before the first backward) makes the
        # next call look again; it is bound then.
        self._heads.extend(
            (self._params[i], torch.empty(0), -1) for i, g in enumerate(grads) if g is None
        )


def _rebind_hook(flat: FlatGrads, index: int, view: Tensor) -> Any:
    # The hook holds the FlatGrads: its parameters keep it alive (a cycle the garbage
    # collector frees with the model), so that an unassigned flatten_grads(model) works.
    def hook(param: Tensor) -> None:
        if param.grad is not view:
            flat._rebind_one(index, param, view)

    return hook


def _check_same_place(param: Tensor, view: Tensor) -> None:
    if (param.dtype, param.device, param.shape) != (view.dtype, view.device, view.shape):
        raise ValueError(
            f"a parameter is now {param.dtype} on {param.device} with shape "
            f"{tuple(param.shape)}, its flat gradient {view.dtype} on {view.device}: the "
            "model was moved or cast after flatten_grads. Call gradlab.flat.flatten_grads(...) "
            "again after model.to(...)."
        )


def _region(buffer: Tensor, offset: int, p: Tensor) -> Tensor:
    """The view of ``buffer[offset:offset + p.numel()]`` shaped, and strided, like ``p``."""
    strides = None if p.is_contiguous() else _dense_strides(p)
    if strides is None:
        return buffer.narrow(0, offset, p.numel()).view(p.shape)
    return buffer.as_strided(p.shape, strides, buffer.storage_offset() + offset)


def _unique_leaves(params: Iterable[Tensor]) -> list[Tensor]:
    if isinstance(params, Tensor):
        params = [params]
    try:
        items = list(params)
    except TypeError:
        raise ValueError(
            f"params must be an iterable of tensors, got {type(params).__name__}"
        ) from None
    seen: set[int] = set()
    out = []
    for p in items:
        if not isinstance(p, Tensor):
            raise ValueError(f"params must contain only tensors, found {type(p).__name__}")
        if type(p) not in PLAIN_TYPES:
            raise ValueError(
                f"params holds a {type(p).__name__} (a DTensor: FSDP2 or tensor "
                "parallelism?); flat buffers are for plain parameters. FSDP2 allocates its "
                "sharded gradients itself at each backward; see gradlab.flat.flatten_grads"
            )
        if not p.requires_grad or id(p) in seen:
            continue
        if not p.is_leaf:
            raise ValueError("params must be leaf tensors (parameters): found a non-leaf tensor")
        if p.layout != torch.strided:
            raise ValueError(f"params must be dense (strided) tensors, found layout {p.layout}")
        seen.add(id(p))
        out.append(p)
    return out


def _take_over(params: list[Tensor]) -> None:
    """Retire the live FlatGrads that ``params`` wholly contain; refuse a partial overlap."""
    ids = {id(p) for p in params}
    owners: dict[int, FlatGrads] = {}
    for p in params:
        ref = _OWNER.get(p)
        flat = ref() if ref is not None else None
        if flat is not None and flat._alive:
            owners[id(flat)] = flat
    for flat in owners.values():
        if not all(id(q) in ids for q in flat._params):
            raise ValueError(
                f"some of these parameters are in another FlatGrads ({flat!r}) that holds "
                "parameters these do not: call .remove() on it first, or flatten them together"
            )
    for flat in owners.values():
        flat.remove()


# ----------------------------------------------------------------- entry points


def flatten_grads(obj: Any, *, rebind: bool = True) -> FlatGrads:
    r"""Put the gradients of a model, an optimizer or a list of parameters into flat buffers.

    The one line that turns flat mode on (see :class:`FlatGrads` and this module's
    docstring for what it gives and costs)::

        flat = gradlab.flat.flatten_grads(model)  # after model.to(device), before training
        ...
        gradlab.clip_grad_norm_(flat, 1.0)

    Call it again after ``optimizer.add_param_group`` (with the optimizer) or after
    freezing or unfreezing parameters: the new :class:`FlatGrads` takes over from the
    old one (which then refuses to be used) and keeps the gradients' values.

    Args:
        obj (Module, Optimizer or Iterable[Tensor]): a :class:`torch.nn.Module` (its
            parameters that require a gradient), a :class:`torch.optim.Optimizer` (the
            parameters of its param groups; a param group added later is refused at the
            next use, with this fix), or parameters.

            * :class:`~torch.nn.parallel.DistributedDataParallel` with
              ``gradient_as_bucket_view=True``: its buckets already are flat buffers with
              the gradients as views, so they are used as they are (no copy, no hook;
              DDP itself keeps its views across ``set_to_none=True``, and rebuilds its
              buckets after the first iteration, which the next use follows). Without
              ``gradient_as_bucket_view`` DDP copies between its buckets and the
              gradients at each step, and a second buffer would be a third copy:
              refused (ValueError) with that fix.
            * FSDP2 (``fully_shard``) and DTensor parameters: refused (ValueError).
              FSDP2 makes fresh sharded gradients at each backward: on each rank they are
              views of one reduce-scatter output per ``fully_shard`` group, with padding
              between shards where a dimension does not divide evenly, and FSDP2 rebinds
              them itself; a buffer of ours would be replaced at the next backward.
              :func:`gradlab.get_total_norm` and the others take those DTensor
              gradients as they are.
            * FSDP1 (``FullyShardedDataParallel``): refused; its ``FlatParameter`` is flat
              already.

        rebind (bool): see :class:`FlatGrads`. Default: True

    Returns:
        FlatGrads: the flat gradients, to pass to the :mod:`gradlab.clip` functions;
        :func:`flat_grads_of` finds it again from the model or the optimizer.

    Raises:
        ValueError: as :class:`FlatGrads`; DDP without ``gradient_as_bucket_view``; FSDP.

    .. note::
        No host read.
    """
    check_flag("rebind", rebind)
    if isinstance(obj, FlatGrads):
        raise ValueError("flatten_grads takes a model, an optimizer or parameters, not a FlatGrads")
    _refuse_fsdp(obj)
    ddp = _ddp_type()
    if ddp is not None and isinstance(obj, ddp):
        if not getattr(obj, "gradient_as_bucket_view", False):
            raise ValueError(
                "DistributedDataParallel without gradient_as_bucket_view=True copies the "
                "gradients between its buckets and .grad at each step, so a flat buffer "
                "would be a third copy. Wrap the model with "
                "DistributedDataParallel(model, gradient_as_bucket_view=True): its buckets "
                "are then flat buffers with each .grad a view, and flatten_grads uses them"
            )
        flat = FlatGrads._of_ddp(obj)
        _LOOKUPS[obj] = (weakref.ref(flat), 0, _GENERATION[0])
        return flat
    if isinstance(obj, torch.optim.Optimizer):
        flat = FlatGrads([p for group in obj.param_groups for p in group["params"]], rebind=rebind)
        flat._optimizer = weakref.ref(obj)
        flat._groups_at_start = len(obj.param_groups)
        _LOOKUPS[obj] = (weakref.ref(flat), len(obj.param_groups), _GENERATION[0])
        return flat
    if isinstance(obj, torch.nn.Module):
        flat = FlatGrads(obj.parameters(), rebind=rebind)
        _LOOKUPS[obj] = (weakref.ref(flat), 0, _GENERATION[0])
        return flat
    return FlatGrads(obj, rebind=rebind)


def _ddp_type() -> Any:
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def _refuse_fsdp(obj: Any) -> None:
    if not (isinstance(obj, torch.nn.Module) and torch.distributed.is_available()):
        return
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    fsdp2 = any(isinstance(m, FSDPModule) for m in obj.modules())
    if fsdp2 or any(type(p) not in PLAIN_TYPES for p in obj.parameters()):
        raise ValueError(
            "flatten_grads cannot flatten FSDP2 (fully_shard) or DTensor parameters: FSDP2 "
            "allocates fresh sharded gradients at each backward (on each rank, views of one "
            "reduce-scatter output per fully_shard group, with padding between shards) and "
            "binds them itself, so a buffer of ours would be replaced. Pass the parameters "
            "to gradlab.clip_grad_norm_ and the others as they are: they take DTensor "
            "gradients (one norm per tensor, reduced over the mesh)"
        )
    if any(isinstance(m, FullyShardedDataParallel) for m in obj.modules()):
        raise ValueError(
            "flatten_grads cannot flatten FSDP1 (FullyShardedDataParallel): its "
            "FlatParameter already holds each unit's gradient in one tensor"
        )


def flat_grads_of(obj: Any) -> FlatGrads | None:
    """The live :class:`FlatGrads` that holds exactly the gradients of ``obj``, or None.

    For :class:`gradlab.StepGuard` and :func:`gradlab.step_if_`, which take an optimizer:
    with a :class:`FlatGrads` found here they skip the walk over the parameters. An
    optimizer matches the :class:`FlatGrads` made from it, or one that holds exactly the
    parameters of its param groups that require a gradient (found once, by one walk,
    and cached until its number of param groups changes or a :class:`FlatGrads` is made
    or removed); a module, the :class:`FlatGrads` made from it.

    Args:
        obj (FlatGrads, Optimizer or Module): what to look up.

    Returns:
        FlatGrads or None.

    .. note::
        No host read. O(1) after the first call for an optimizer.
    """
    if isinstance(obj, FlatGrads):
        return obj if obj._alive else None
    groups = len(obj.param_groups) if isinstance(obj, torch.optim.Optimizer) else 0
    try:
        cached = _LOOKUPS.get(obj)
    except TypeError:  # not weakly referenceable: nothing was registered for it
        return None
    if cached is not None and cached[1] == groups and cached[2] == _GENERATION[0]:
        flat = cached[0]() if cached[0] is not None else None
        return flat if flat is not None and flat._alive else None
    flat = None
    if isinstance(obj, torch.optim.Optimizer):
        flat = _exact_owner([p for g in obj.param_groups for p in g["params"] if p.requires_grad])
    elif cached is not None and cached[0] is not None:
        flat = cached[0]()
    flat = flat if flat is not None and flat._alive else None
    _LOOKUPS[obj] = (weakref.ref(flat) if flat is not None else None, groups, _GENERATION[0])
    return flat


def _exact_owner(params: list[Tensor]) -> FlatGrads | None:
    if not params:
        return None
    ref = _OWNER.get(params[0])
    flat = ref() if ref is not None else None
    if flat is None or not flat._alive:
        return None
    ids = {id(p) for p in params}
    if len(ids) != len(flat._params) or not all(id(p) in ids for p in flat._params):
        return None
    return flat


# --------------------------------------------------------------- coalescing views


class FlatRuns(list):
    """A list of 1-D views of gradient buffers, each entry of the gradients in exactly one:
    what :meth:`FlatGrads.grads` and :func:`coalesce` return. The :mod:`gradlab.clip`
    functions reduce it in any order: one kernel per run, and one buffer's norm is the
    total norm itself."""


#: id(view) -> (the view, a weak reference to its FlatGrads, its parameter's index), for
#: every view of a live FlatGrads: finding a gradient's region is one dictionary lookup.
#: A FlatGrads removes its entries when removed or collected.
_SLOTS: dict[int, tuple[Tensor, weakref.ref, int]] = {}


def _drop_slots(keys: list[int], owner: weakref.ref) -> None:
    """Forget the views of one FlatGrads (only its own entries: an id can be reused)."""
    for key in keys:
        entry = _SLOTS.get(key)
        if entry is not None and entry[1] is owner:
            del _SLOTS[key]


def _registered_runs(tensors: list[Tensor]) -> list[Tensor] | None:
    """coalesce for gradients that are views of FlatGrads buffers: one lookup each.

    The others are kept as they are, after the runs. None if a view is given twice.
    """
    # map and operator keep the per-tensor work in C: this is the walk a FlatGrads skips.
    entries = list(map(_SLOTS.get, map(id, tensors)))
    if None not in entries and all(map(operator.is_, map(_VIEW, entries), tensors)):
        refs = set(map(_FLAT, entries))
        if len(refs) == 1:
            return _runs_in(next(iter(refs))(), list(map(_INDEX, entries)))
    by_flat: dict[int, tuple[weakref.ref, list[int]]] = {}
    others = []
    for entry, t in zip(entries, tensors, strict=True):
        if entry is None or entry[0] is not t:
            others.append(t)
        else:
            by_flat.setdefault(id(entry[1]), (entry[1], []))[1].append(entry[2])
    runs: list[Tensor] = []
    for ref, indices in by_flat.values():
        found = _runs_in(ref(), indices)
        if found is None:
            return None
        runs.extend(found)
    return FlatRuns(runs) if not others else runs + others


_VIEW: Any = operator.itemgetter(0)
_FLAT: Any = operator.itemgetter(1)
_INDEX: Any = operator.itemgetter(2)


def _runs_in(flat: FlatGrads | None, indices: list[int]) -> list[Tensor] | None:
    """The runs of ``flat``'s buffers that hold the parameters ``indices``; None if an
    index repeats, ``flat`` is gone, or its views no longer use its buffers (``.data``
    replaced by ``model.to(...)``: the per-tensor path then acts where they are)."""
    if flat is None or not flat._alive or len(set(indices)) != len(indices):
        return None
    if not torch.compiler.is_compiling() and any(
        view.data_ptr() != address for _, view, address in flat._heads
    ):
        return None
    if len(indices) == len(flat._params):
        return FlatRuns(flat._runs)  # all of them: the whole buffers
    ranks: dict[int, list[int]] = {}
    for i in indices:
        buffer_no, rank = flat._where[i]
        ranks.setdefault(buffer_no, []).append(rank)
    runs: list[Tensor] = []
    for buffer_no, chosen in sorted(ranks.items()):
        runs.extend(flat._slices(buffer_no, sorted(chosen)))
    return FlatRuns(runs)


def _runs_of(tensors: list[Tensor]) -> tuple[list[Tensor] | None, list[list[int]]]:
    """The 1-D views covering exactly ``tensors``' entries, merging adjacent views of a
    common base; with, for each, the positions in ``tensors`` it covers, in buffer order.

    (None, []) if any tensor is not a dense view of a contiguous base of its own dtype,
    or two of them overlap (a tensor given twice: per-tensor semantics count it twice).
    """
    spans: dict[int, tuple[Tensor, list[tuple[Any, Any, int]]]] = {}
    for pos, t in enumerate(tensors):
        base = t._base
        if (
            base is None
            or type(t) not in PLAIN_TYPES
            or base.dtype != t.dtype
            or t.numel() == 0
            or not _covers_its_span(t)
        ):
            return None, []
        start = t.storage_offset() - base.storage_offset()
        entry = spans.get(id(base))
        if entry is None:
            if not base.is_contiguous():
                return None, []
            entry = spans[id(base)] = (base, [])
        entry[1].append((start, start + t.numel(), pos))
    runs: list[tuple[int, Tensor, list[int]]] = []
    for base, items in spans.values():
        items.sort()
        flat_base = base.view(-1)
        begin, end, members = items[0][0], items[0][1], [items[0][2]]
        for start, stop, pos in items[1:]:
            if start < end:
                return None, []
            if start > end:
                runs.append((min(members), _slice(flat_base, begin, end), members))
                begin, members = start, []
            end = stop
            members.append(pos)
        runs.append((min(members), _slice(flat_base, begin, end), members))
    runs.sort(key=lambda r: r[0])
    return FlatRuns(r[1] for r in runs), [r[2] for r in runs]


def _slice(flat_base: Tensor, begin: int, end: int) -> Tensor:
    return flat_base if begin == 0 and end == flat_base.numel() else flat_base[begin:end]


def coalesce(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors``, with the views of a common buffer merged into one 1-D view per run.

    The slow path of flat mode, for a list of gradients rather than a :class:`FlatGrads`.
    Gradients that are views of :class:`FlatGrads` buffers are found by one dictionary
    lookup each, and any others are kept as they are (a parameter added after
    flattening, say). Otherwise tensors that are all dense views of a contiguous base
    (DDP's buckets with ``gradient_as_bucket_view=True``, a buffer of yours) are merged
    where they lie next to each other. Either way a norm, a rescaling, a zeroing or a
    clamp is then one kernel per run, over exactly the same entries, each once.

    Returned unchanged: when the first tensor is neither (the common case, decided in
    O(1)); when a tensor is given twice or two views overlap (the per-tensor semantics
    count it twice); under :func:`torch.compile` (which fuses the per-tensor work
    itself); for fewer than two tensors.

    Args:
        tensors (list[Tensor]): gradients (plain tensors).

    Returns:
        list[Tensor]: the runs (and the tensors that are in none), or ``tensors``.

    Raises:
        ValueError: as :meth:`FlatGrads.grads`, for a FlatGrads whose views are gone.

    .. note::
        No host read. Costs a few hundred nanoseconds of Python per tensor (measured in
        ``benchmarks/bench_flat.py``); pass a :class:`FlatGrads` to skip it.
    """
    if len(tensors) < 2 or torch.compiler.is_compiling():
        return tensors
    first = tensors[0]
    entry = _SLOTS.get(id(first))
    if entry is not None and entry[0] is first:
        runs = _registered_runs(tensors)
    elif first._base is not None:
        runs = _runs_of(tensors)[0]
    else:
        return tensors
    return tensors if runs is None else runs
