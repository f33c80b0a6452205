r"""The self-check of the costs chapter: coalescing gradients that are views of one buffer.

Built from :mod:`gradlab_book.exercise_kit` like every check: :func:`check_coalesce_views`
takes the student's function, runs it on a fixed battery of small cases and prints one
short verdict, ``All N cases pass.`` or the *first* case that fails (its input, what was
expected, what came back and, where the answer matches a typical mistake, which one).
It returns True or False and never raises because an answer is wrong.

What is checked is memory, not values: which entries of which storage each returned
tensor covers. The reference is computed here from the tensors' storages, offsets and
strides, independently of :func:`gradlab.flat.coalesce`; that function, whose
documented rule the contract restates, passes the check (see its tests).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import gradlab
from gradlab_book.exercise_kit import answer, rejects_host_read, say, value_text

__all__ = ["check_coalesce_views"]


# --------------------------------------------------------------- the reference


def _cells(t: Tensor) -> Counter:
    """The (storage, element index) pairs that ``t`` covers, with multiplicity."""
    storage = t.untyped_storage()
    size = storage.nbytes() // t.element_size()
    index = torch.arange(size, dtype=torch.int64).as_strided(
        t.shape, t.stride(), t.storage_offset()
    )
    ptr = storage.data_ptr()
    return Counter((ptr, int(i)) for i in index.reshape(-1).tolist())


def _mergeable(t: Tensor) -> bool:
    """A contiguous view, with entries, of a contiguous base of its own dtype."""
    base = t._base
    return (
        base is not None
        and base.is_contiguous()
        and base.dtype == t.dtype
        and t.is_contiguous()
        and t.numel() > 0
    )


def _expected_runs(tensors: Sequence[Tensor]) -> int | None:
    """How many tensors the answer returns: the number of runs of back-to-back views, or
    None when the list must come back unchanged (fewer than two tensors, one that is not
    a mergeable view, or two that overlap)."""
    if len(tensors) < 2 or not all(_mergeable(t) for t in tensors):
        return None
    total = Counter()
    for t in tensors:
        total.update(_cells(t))
    if any(n > 1 for n in total.values()):
        return None
    spans: dict[int, list[tuple[int, int]]] = {}
    for t in tensors:
        start = t.storage_offset() - t._base.storage_offset()
        spans.setdefault(id(t._base), []).append((start, start + t.numel()))
    runs = 0
    for items in spans.values():
        items.sort()
        runs += 1 + sum(1 for (_, end), (start, _) in itertools.pairwise(items) if start != end)
    return runs


# -------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class _Case:
    title: str
    inputs: str  # what the list holds, in words
    make: Callable[[], list[Tensor]]
    hint: str = ""


def _buffer(n: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(dtype)


def _back_to_back() -> list[Tensor]:
    buf = _buffer(13, 0)
    return [buf[0:6].view(2, 3), buf[6:10], buf[10:13].view(3, 1)]


def _shuffled() -> list[Tensor]:
    a, b, c = _back_to_back()
    return [c, a, b]


def _gap() -> list[Tensor]:
    buf = _buffer(10, 1)
    return [buf[0:4], buf[4:6], buf[8:10]]


def _two_buffers() -> list[Tensor]:
    first, second = _buffer(8, 2), _buffer(6, 3)
    return [first[0:5], second[0:2], first[5:8], second[2:6].view(2, 2)]


def _model() -> list[Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    flat = gradlab.flatten_grads(model)
    grads = [p.grad for p in model.parameters()]
    _KEEP_ALIVE.append((model, flat))
    return grads


#: The model of a case and its FlatGrads live as long as the check runs.
_KEEP_ALIVE: list[object] = []


def _plain() -> list[Tensor]:
    return [_buffer(4, 4), _buffer(3, 5), _buffer(2, 6)]


def _views_and_plain() -> list[Tensor]:
    buf = _buffer(9, 7)
    return [buf[0:4], buf[4:9], _buffer(3, 8)]


def _strided() -> list[Tensor]:
    buf = _buffer(12, 9)
    return [buf[0:4], buf[4:12:2]]


def _twice() -> list[Tensor]:
    buf = _buffer(8, 10)
    a = buf[0:4]
    return [a, buf[4:8], a]


def _overlap() -> list[Tensor]:
    buf = _buffer(10, 11)
    return [buf[0:6], buf[4:10]]


def _half() -> list[Tensor]:
    buf = _buffer(10, 12, torch.float16)
    return [buf[0:3], buf[3:10].view(7, 1)]


_SEE_BASE = (
    "Group the views by their base (t._base), sort each group by its offset in the base "
    "(t.storage_offset() - base.storage_offset()), and start a new run wherever one view "
    "does not begin where the previous one ends."
)


def _cases() -> list[_Case]:
    return [
        _Case(
            "three views that lie back to back in one buffer of 13",
            "buf[0:6].view(2, 3), buf[6:10], buf[10:13].view(3, 1)",
            _back_to_back,
            "They fill buf[0:13] without a gap: one run, base.view(-1)[0:13].",
        ),
        _Case(
            "the same three views, listed out of order",
            "buf[10:13].view(3, 1), buf[0:6].view(2, 3), buf[6:10]",
            _shuffled,
            "Sort the views of a base by their offset before looking for runs: the order "
            "of the list is not the order in memory.",
        ),
        _Case(
            "views with a gap between them",
            "buf[0:4], buf[4:6], buf[8:10] of a buffer of 10",
            _gap,
            "buf[6:8] is in none of them: a run stops at a gap, so this is two runs, "
            "buf[0:6] and buf[8:10].",
        ),
        _Case(
            "views of two buffers, interleaved (as DDP's buckets are)",
            "first[0:5], second[0:2], first[5:8], second[2:6].view(2, 2)",
            _two_buffers,
            "Views of different bases never merge: one run per buffer here.",
        ),
        _Case(
            "the gradients of a small model after gradlab.flatten_grads(model)",
            "[p.grad for p in model.parameters()], 4 views of one flat buffer",
            _model,
            _SEE_BASE,
        ),
        _Case(
            "three plain tensors (none is a view)",
            "three tensors of 4, 3 and 2 entries, each its own storage",
            _plain,
            "A tensor that is not a view (t._base is None) cannot be merged: return the "
            "tensors as they are.",
        ),
        _Case(
            "two views and one plain tensor",
            "buf[0:4], buf[4:9], and a tensor of 3 entries of its own",
            _views_and_plain,
            "The contract merges only when every tensor is a view of a contiguous base; "
            "here one is not, so the list comes back as it is (as gradlab.flat.coalesce "
            "does).",
        ),
        _Case(
            "a strided view among them",
            "buf[0:4], buf[4:12:2] (every second entry)",
            _strided,
            "buf[4:12:2] is not contiguous: a run over its span would also cover the "
            "entries between its own. Check t.is_contiguous(); here the list comes back "
            "as it is.",
        ),
        _Case(
            "one view given twice",
            "a = buf[0:4]; [a, buf[4:8], a]",
            _twice,
            "A tensor given twice counts twice in a per-tensor norm; merged, it would count "
            "once. When two tensors overlap, return the list as it is.",
        ),
        _Case(
            "two views that overlap",
            "buf[0:6], buf[4:10]",
            _overlap,
            "buf[4:6] is in both: when two tensors overlap, return the list as it is.",
        ),
        _Case("an empty list", "[]", list, "An empty list comes back empty."),
        _Case(
            "a single view",
            "buf[2:5] of a buffer of 8",
            lambda: [_buffer(8, 13)[2:5]],
            "With fewer than two tensors there is nothing to merge: return the list as it is.",
        ),
        _Case(
            "two float16 views back to back",
            "buf[0:3], buf[3:10].view(7, 1) of a float16 buffer",
            _half,
            "A run is a view of the base itself, so it keeps the base's dtype: "
            "base.view(-1)[start:end], never a copy or a cast.",
        ),
    ]


# ------------------------------------------------------------------ the check


def _describe(items: Sequence[object]) -> str:
    parts = []
    for t in items:
        if isinstance(t, Tensor):
            parts.append(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}")
        else:
            parts.append(value_text(t))
    return "[" + ", ".join(parts) + "]"


def check_coalesce_views(fn: Callable) -> bool:
    """Check ``fn(tensors) -> list[Tensor]``: merge gradients that lie back to back.

    The contract (the rule of :func:`gradlab.flat.coalesce` for tensors that are not in
    a :class:`gradlab.flat.FlatGrads`): if the list holds at least two tensors, every
    one a contiguous view (``t._base`` is not None) of a contiguous base of its own
    dtype, and no two share an entry, return a list with one 1-D view of the base per
    run of views that lie back to back in it (in any order); otherwise return the same
    tensors, unchanged. Either way the result covers exactly the entries of the input,
    each once, in the same memory (no copy, no cast); the list given, and its tensors'
    values, are left as they were, and no value is read on the host.

    Args:
        fn (Callable): the student's function.

    Returns:
        bool: whether every case passes.

    .. note::
        Prints the verdict; reads nothing on the host beyond the answer's own reads.
    """
    if not callable(fn):
        say([f"Expected a function, got {value_text(fn)}."])
        return False
    cases = _cases()
    try:
        for index, case in enumerate(cases, start=1):
            if not _one_case(fn, case, index, len(cases)):
                return False
    finally:
        _KEEP_ALIVE.clear()
    say([f"All {len(cases)} cases pass."])
    return True


def _one_case(fn: Callable, case: _Case, index: int, total: int) -> bool:
    tensors = case.make()
    given = list(tensors)
    values = [t.detach().clone() for t in tensors]
    runs = _expected_runs(given)
    header = [
        f"Case {index} of {total} fails: {case.title}.",
        "  call:     fn(tensors)",
        f"  tensors:  {case.inputs}",
    ]
    if runs is None:
        header.append(f"  expected: the same {len(given)} tensor(s), unchanged")
    else:
        header.append(f"  expected: {runs} run(s), 1-D views of the base(s)")
    hint = [f"  Hint: {case.hint}"] if case.hint else []
    ok, result, reads = answer(fn, "fn(tensors)", header, hint, tensors)
    if not ok:
        return False

    def fail(*lines: str, with_hint: bool = True) -> bool:
        say([*header, *lines, *(hint if with_hint else [])])
        return False

    if rejects_host_read(reads, header[0], "fn(tensors)"):
        return False
    if len(tensors) != len(given) or any(a is not b for a, b in zip(tensors, given, strict=False)):
        say(
            [
                *header,
                "  Your function changed the list it was given (list.sort, pop, append or "
                "an assignment into it): the caller's list of gradients must stay as it "
                "was. Work on a copy, e.g. sorted(tensors, key=...).",
            ]
        )
        return False
    if any(not torch.equal(t.detach(), v) for t, v in zip(given, values, strict=True)):
        return fail(
            "  Your function changed a gradient's values: coalescing only builds views.",
            with_hint=False,
        )
    if not isinstance(result, list | tuple) or not all(isinstance(t, Tensor) for t in result):
        return fail(f"  got:      {value_text(result)}; return a list of tensors.")
    got = list(result)
    want = Counter()
    for t in given:
        want.update(_cells(t))
    have = Counter()
    for t in got:
        have.update(_cells(t))
    storages = {t.untyped_storage().data_ptr() for t in given}
    if any(t.untyped_storage().data_ptr() not in storages for t in got):
        return fail(
            f"  got:      {_describe(got)}, some of it in new memory",
            "  A returned tensor is a copy (torch.cat, clone, .to(dtype) or .contiguous() "
            "of a strided view make new memory): a run must be a view of the base, "
            "base.view(-1)[start:end], so that writing into it writes the gradients.",
            with_hint=False,
        )
    if have != want and any(n > 1 for n in want.values()):
        return fail(
            f"  got:      {_describe(got)}",
            "  Some entries are in two of the tensors given (a tensor given twice, or views "
            "that overlap): merged, they would count once where a per-tensor norm counts "
            "them twice. Return the list as it is.",
            with_hint=False,
        )
    if have != want:
        extra = sum((have - want).values())
        missing = sum((want - have).values())
        words = []
        if missing:
            words.append(f"{missing} entr{'y' if missing == 1 else 'ies'} of the input left out")
        if extra:
            words.append(
                f"{extra} entr{'y' if extra == 1 else 'ies'} covered that the input does "
                "not cover, or covered twice"
            )
        return fail(f"  got:      {_describe(got)}: {'; '.join(words)}")
    if runs is None:
        if len(got) != len(given) or any(a is not b for a, b in zip(got, given, strict=True)):
            return fail(
                f"  got:      {_describe(got)}",
                "  Here the same tensors must come back, in the same order, as they are.",
            )
        return True
    if len(got) != runs:
        return fail(f"  got:      {len(got)} tensor(s), {_describe(got)}")
    if runs < len(given) and any(t.dim() != 1 for t in got if all(t is not g for g in given)):
        return fail(
            f"  got:      {_describe(got)}",
            "  A run is one 1-D view (base.view(-1)[start:end]), whatever the shapes of "
            "the views it merges.",
        )
    return True
