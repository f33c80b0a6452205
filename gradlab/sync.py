"""One meaning of "host read", and one detector for it, that works without a GPU.

A *host read* is anything that makes the host wait for a tensor's value. On a GPU it
stalls the CPU until every queued kernel has run; on the CPU it is cheap, but it goes
through the same operations, so catching it on a laptop shows what would synchronise
on a GPU. Three kinds:

* an operator that hands a value to Python: ``.item()``, ``float(t)``, ``int(t)``,
  ``bool(t)`` (so a tensor in an ``if``), ``torch.equal``, ``torch.allclose``;
* an operator whose output *shape* depends on the values: ``nonzero``,
  ``masked_select``, ``unique``, and boolean-mask indexing (``g[mask]``,
  ``g[mask] = 0``, which turn the mask into indices first);
* a method that reads memory without dispatching an operator: ``.tolist()``,
  ``.numpy()``, ``__array__`` (``np.asarray(t)``), and printing or formatting a tensor.

The first two are seen by a dispatch mode (:data:`READ_OPS`, :func:`is_read_op`); the
third only by a ``__torch_function__`` mode. :class:`HostReadCounter` runs both, and
counts one read per torch call however many operators it dispatches (``allclose`` is
``isclose``, ``all`` and one ``_local_scalar_dense``), naming the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["READ_OPS", "HostReadCounter", "HostReadError", "is_read_op", "no_host_reads"]

_aten = torch.ops.aten

#: Operators that hand a value to the host, or whose output shape depends on values.
READ_OPS = frozenset(
    {
        _aten._local_scalar_dense.default,  # .item(), float(t), bool(t), `if t`
        _aten.item.default,
        _aten.is_nonzero.default,
        _aten.equal.default,
        _aten.allclose.default,  # CPU: one operator, its .item() inside is not dispatched
        _aten.nonzero.default,
        _aten.masked_select.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
        _aten.unique_dim_consecutive.default,
    }
)

#: Indexing operators, which read the host only when an index is a boolean mask.
_INDEX_OPS = frozenset({_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default})

#: Tensor methods that read memory without an operator. Printing turns dispatch
#: modes off while it reads the values, so it is seen here too.
_PYTHON_READS = frozenset(
    {Tensor.tolist, Tensor.numpy, Tensor.__array__, Tensor.__repr__, Tensor.__format__}
)

#: How the operations that read are named, where the qualified name is not clear.
_NAMES = {
    Tensor.__bool__: "bool(t), or a tensor in an `if`",
    Tensor.__float__: "float(t)",
    Tensor.__int__: "int(t)",
    Tensor.__index__: "a tensor used as a Python int (__index__)",
    Tensor.__getitem__: "indexing t[...]",
    Tensor.__setitem__: "indexed assignment t[...] = ...",
    Tensor.__contains__: "`x in t`",
    Tensor.__array__: "np.asarray(t) (Tensor.__array__)",
    Tensor.__repr__: "printing a tensor",
    Tensor.__format__: "formatting a tensor",
    Tensor.item: "Tensor.item()",
    Tensor.tolist: "Tensor.tolist()",
    Tensor.numpy: "Tensor.numpy()",
    torch.unique: "torch.unique",
    torch.unique_consecutive: "torch.unique_consecutive",
}


def is_read_op(func: object, args: Sequence[object] = ()) -> bool:
    """Whether dispatching the aten operator ``func`` on ``args`` reads the host."""
    if func in READ_OPS:
        return True
    if func in _INDEX_OPS and len(args) > 1 and isinstance(args[1], list | tuple):
        return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    return False


def _name(func: Callable) -> str:
    return _NAMES.get(func) or resolve_name(func) or getattr(func, "__name__", repr(func))


class HostReadError(RuntimeError):
    """Raised under :func:`no_host_reads` by the first host read, naming it."""


class _Calls(TorchFunctionMode):
    """Sees every torch call: counts the Python-level reads, names the others."""

    def __init__(self, counter: HostReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # This mode is off while func runs, so only outermost calls get here.
        counter = self.counter
        counter._call, counter._call_has_read = func, False
        try:
            if func in _PYTHON_READS:
                counter._record(_name(func))
            return func(*args, **(kwargs or {}))
        finally:
            counter._call = None


class _Ops(TorchDispatchMode):
    """Sees every aten operator: records the reads, one per torch call."""

    def __init__(self, counter: HostReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        counter = self.counter
        if is_read_op(func, args) and not counter._call_has_read:
            op = f"aten.{func.__name__}"
            if func in _INDEX_OPS:
                op += " with a boolean mask"
            counter._record(op if counter._call is None else f"{_name(counter._call)} ({op})")
        return func(*args, **(kwargs or {}))


class HostReadCounter:
    """Count, and name, the host reads made while active (see :mod:`gradlab.sync`).

    Each torch call that reads counts once, named as the call, with the operator
    where one is dispatched: ``"torch.equal (aten.equal.default)"``,
    ``"Tensor.tolist()"``.

    Args:
        raise_on_read (bool): raise :class:`HostReadError` at the first read instead of
            counting on. Default: False

    Attributes:
        operations (list[str]): the name of each read, in order.
        count (int): how many reads, ``len(operations)``.

    Example::

        with HostReadCounter() as reads:
            gradlab.grad_ignore_norm_(model.parameters(), 1.0)
        assert reads.count == 0, reads.operations
    """

    def __init__(self, *, raise_on_read: bool = False) -> None:
        self.operations: list[str] = []
        self._raise = raise_on_read
        self._call: Callable | None = None  # the outermost torch call running now
        self._call_has_read = False  # so that its operators count once
        self._stack: contextlib.ExitStack | None = None

    @property
    def count(self) -> int:
        return len(self.operations)

    def _record(self, operation: str) -> None:
        self._call_has_read = self._call is not None
        self.operations.append(operation)
        if self._raise:
            raise HostReadError(f"{operation} reads a tensor value on the host")

    def __enter__(self) -> HostReadCounter:
        stack = contextlib.ExitStack()
        stack.enter_context(_Calls(self))
        stack.enter_context(_Ops(self))
        self._stack = stack
        return self

    def __exit__(self, *exc_info) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*exc_info)


def no_host_reads() -> HostReadCounter:
    """A context in which the first host read raises :class:`HostReadError`, naming it.

    Example::

        with no_host_reads():
            gradlab.clip_grad_norm_(model.parameters(), 1.0)
    """
    return HostReadCounter(raise_on_read=True)
