"""The costs chapter's check accepts correct answers and rejects the typical wrong ones.

Two correct answers are written here independently (sorting the views by offset, and
marking the covered entries of each base); gradlab's own ``gradlab.flat.coalesce``
must pass as well, since the contract restates its documented rule. The check's
reference is compared with run counts worked out by hand. Wrong answers must be
rejected with a verdict that names the mistake.
"""

from __future__ import annotations

import itertools

import torch
from verdicts import assert_fails, assert_passes, run

from gradlab.flat import coalesce
from gradlab_book import exercises_costs as ex
from gradlab_book.exercises_costs import check_coalesce_views

N = len(ex._cases())


def _viewable(ts):
    return len(ts) >= 2 and all(
        t._base is not None
        and t._base.is_contiguous()
        and t._base.dtype == t.dtype
        and t.is_contiguous()
        and t.numel() > 0
        for t in ts
    )


def _offset_in_base(t):
    return t.storage_offset() - t._base.storage_offset()


def _runs(base, spans):
    # the views of base over sorted, non-overlapping [start, end) spans: one run per
    # stretch without a gap
    flat = base.view(-1)
    out = []
    begin, end = spans[0]
    for s, e in spans[1:]:
        if s != end:
            out.append(flat[begin:end])
            begin = s
        end = e
    out.append(flat[begin:end])
    return out


def _spans_by_base(ts, length):
    # each base with the [start, end) spans of its views, in list order
    groups = {}
    for t in ts:
        start = _offset_in_base(t)
        groups.setdefault(id(t._base), (t._base, []))[1].append((start, start + length(t)))
    return groups.values()


def by_offsets(tensors):
    """Sort each base's views by offset; a new run wherever one does not start at the end."""
    ts = list(tensors)
    if not _viewable(ts):
        return ts
    out = []
    for base, spans in _spans_by_base(ts, torch.Tensor.numel):
        spans.sort()
        if any(s < e for (_, e), (s, _) in itertools.pairwise(spans)):
            return ts
        out += _runs(base, spans)
    return out


def by_marks(tensors):
    """Mark each base's covered entries in a count array; runs are the stretches of 1s."""
    ts = list(tensors)
    if not _viewable(ts):
        return ts
    marks = {}
    for t in ts:
        base = t._base
        count = marks.setdefault(id(base), (base, [0] * base.numel()))[1]
        start = _offset_in_base(t)
        for i in range(start, start + t.numel()):
            count[i] += 1
    if any(c > 1 for _, count in marks.values() for c in count):
        return ts
    out = []
    for base, count in marks.values():
        i = 0
        while i < len(count):
            if count[i]:
                j = i
                while j < len(count) and count[j]:
                    j += 1
                out.append(base.view(-1)[i:j])
                i = j
            else:
                i += 1
    return out


def test_correct_answers_pass(capsys):
    for fn in (by_offsets, by_marks, coalesce):
        assert_passes(check_coalesce_views, fn, capsys)
    assert N >= 13


def test_the_verdict_is_deterministic(capsys):
    first = run(check_coalesce_views, list, capsys)
    assert run(check_coalesce_views, list, capsys) == first


def test_reference_counts_by_hand():
    counts = [ex._expected_runs(case.make()) for case in ex._cases()]
    # back to back, shuffled, a gap, two buffers, a flattened model; then the cases
    # that come back unchanged; a single view; two float16 views
    assert counts == [1, 1, 2, 2, 1, None, None, None, None, None, None, None, 1]


# -------------------------------------------------------------- wrong answers


def test_no_merge_is_rejected(capsys):
    assert_fails(check_coalesce_views, list, capsys, "Case 1 of", "expected: 1 run(s)")


def test_a_copy_is_rejected(capsys):
    def cat(tensors):
        return [torch.cat([t.reshape(-1) for t in tensors])] if tensors else []

    assert_fails(check_coalesce_views, cat, capsys, "Case 1 of", "is a copy (torch.cat")


def test_sorting_the_callers_list_is_rejected(capsys):
    def sorts(tensors):
        tensors.sort(key=lambda t: t.storage_offset())
        return by_offsets(tensors)

    assert_fails(check_coalesce_views, sorts, capsys, "Case 2 of", "changed the list it was given")


def test_unsorted_runs_are_rejected(capsys):
    def in_list_order(tensors):
        ts = list(tensors)
        if not _viewable(ts):
            return ts
        out, begin, end, base = [], None, None, None
        for t in ts:
            start = _offset_in_base(t)
            if base is t._base and start == end:
                end = start + t.numel()
                continue
            if base is not None:
                out.append(base.view(-1)[begin:end])
            base, begin, end = t._base, start, start + t.numel()
        out.append(base.view(-1)[begin:end])
        return out

    assert_fails(check_coalesce_views, in_list_order, capsys, "Case 2 of", "out of order")


def test_merging_across_a_gap_is_rejected(capsys):
    def span(tensors):
        ts = list(tensors)
        if not _viewable(ts):
            return ts
        # one view per base, from its views' lowest start to their highest end
        return [
            base.view(-1)[min(s for s, _ in spans) : max(e for _, e in spans)]
            for base, spans in _spans_by_base(ts, torch.Tensor.numel)
        ]

    assert_fails(check_coalesce_views, span, capsys, "Case 3 of", "does not cover")


def test_merging_what_it_can_is_rejected(capsys):
    def partial(tensors):
        views = [t for t in tensors if t._base is not None]
        plain = [t for t in tensors if t._base is None]
        return (by_offsets(views) if len(views) >= 2 else views) + plain

    assert_fails(check_coalesce_views, partial, capsys, "Case 7 of", "as it is")


def test_merging_a_strided_view_is_rejected(capsys):
    def no_contiguity_check(tensors):
        ts = list(tensors)
        if len(ts) < 2 or any(t._base is None for t in ts):
            return ts
        out = []
        # a view's span taken from its first entry to its last
        for base, spans in _spans_by_base(ts, lambda t: (t.numel() - 1) * t.stride(-1) + 1):
            out += _runs(base, sorted(spans))
        return out

    assert_fails(check_coalesce_views, no_contiguity_check, capsys, "Case 8 of", "does not cover")


def test_merging_overlaps_is_rejected(capsys):
    def no_overlap_check(tensors):
        ts = list(tensors)
        seen, unique = set(), []
        for t in ts:
            if id(t) not in seen:
                seen.add(id(t))
                unique.append(t)
        return by_offsets(unique) if len(unique) >= 2 else unique

    assert_fails(check_coalesce_views, no_overlap_check, capsys, "Case 9 of", "count once")


def test_changing_values_is_rejected(capsys):
    def zeroes(tensors):
        for t in tensors:
            t.zero_()
        return by_offsets(tensors)

    assert_fails(check_coalesce_views, zeroes, capsys, "Case 1 of", "changed a gradient's values")


def test_a_host_read_is_rejected(capsys):
    def reads(tensors):
        if tensors and float(tensors[0].sum()) != 0.5:
            return by_offsets(tensors)
        return list(tensors)

    assert_fails(check_coalesce_views, reads, capsys, "Case 1 of", "reads a tensor value")


def test_not_a_list_is_rejected(capsys):
    def gives_tensor(tensors):
        return tensors[0] if tensors else []

    assert_fails(check_coalesce_views, gives_tensor, capsys, "return a list of tensors")


def test_a_raise_is_a_sentence(capsys):
    def raises(tensors):
        raise RuntimeError("boom")

    assert_fails(check_coalesce_views, raises, capsys, "Your function raised RuntimeError: boom")
    assert_fails(check_coalesce_views, 3, capsys, "Expected a function")
