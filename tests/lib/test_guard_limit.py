"""StepGuard's limit on skips in a row: one semantics for sync=True and sync=False.

``max_consecutive_skips=N`` allows N skipped steps in a row; the step that would be the
(N+1)-th acts by ``on_skip_limit``. The references here are written from that sentence
alone: a list of which steps are over the threshold gives, step by step, what must happen.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradlab import SkipLimitError, StepGuard
from gradlab.sync import HostReadCounter

THRESHOLD = 1.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))


def _stream(over: list[bool]):
    """Batches whose gradient norm is above THRESHOLD exactly where ``over`` says."""
    g = torch.Generator().manual_seed(3)
    batches = []
    for is_over in over:
        x, y = torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)
        batches.append((x, y * (200.0 if is_over else 0.01)))
    return batches


def _backward(model, batch) -> float:
    x, y = batch
    nn.functional.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm().item()


def _first_over_limit(over: list[bool], limit: int) -> int | None:
    """The first step that would be the (limit+1)-th skip in a row (None if none)."""
    run = 0
    for i, is_over in enumerate(over):
        run = run + 1 if is_over else 0
        if run == limit + 1:
            return i
    return None


def _take_reference(over: list[bool], limit: int, make_opt):
    """Skip over-threshold steps; after `limit` skips in a row take the next one clipped."""
    model = _model()
    opt = make_opt(model.parameters())
    run = 0
    for batch in _stream(over):
        norm = _backward(model, batch)
        within = norm <= THRESHOLD - 1e-6  # far from the boundary in these streams
        if within or run >= limit:
            torch.nn.utils.clip_grad_norm_(model.parameters(), THRESHOLD)
            opt.step()
            run = 0
        else:
            run += 1
        opt.zero_grad()
    return model, opt


OVER = [False, True, True, True, False, True, True, True, True, True, True, True, False]
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}


@pytest.mark.parametrize("mode", ["skip", "clip"])
@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_take_takes_the_step_after_the_limit_clipped(name, sync, mode):
    limit = 3
    ref_model, ref_opt = _take_reference(OVER, limit, OPTIMIZERS[name])
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    extra = {"skip_above": THRESHOLD} if mode == "clip" else {}
    guard = StepGuard(
        opt,
        mode,
        threshold=THRESHOLD,
        sync=sync,
        max_consecutive_skips=limit,
        on_skip_limit="take",
        history=len(OVER),
        **extra,
    )
    for batch in _stream(OVER):
        _backward(model, batch)
        guard.step()
        opt.zero_grad()
    decisions = [r.decision for r in guard.history]
    # steps 1-3 skipped; 5-7 skipped, 8 taken (the 4th in a row), 9-11 skipped again
    taken = [i for i, d in enumerate(decisions) if d != "skipped"]
    assert taken == [0, 4, 8, 12]
    assert guard.consecutive_skips == 0
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    ref_state = ref_opt.state_dict()["state"]
    for k, entries in opt.state_dict()["state"].items():
        for key, value in entries.items():
            torch.testing.assert_close(value, ref_state[k][key], rtol=0, atol=0)


@pytest.mark.parametrize("sync", [True, False])
def test_take_never_takes_a_non_finite_step(sync):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = StepGuard(
        opt, threshold=THRESHOLD, sync=sync, max_consecutive_skips=2, on_skip_limit="take"
    )
    before = copy.deepcopy(model.state_dict())
    for _ in range(6):
        _backward(model, _stream([False])[0])
        for p in model.parameters():
            p.grad[0] = float("nan")
        guard.step()
        opt.zero_grad()
    assert guard.skipped == 6
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("sync", [True, False])
def test_take_reads_nothing_on_the_host_with_sync_false(sync):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    guard = StepGuard(
        opt, threshold=THRESHOLD, sync=sync, max_consecutive_skips=2, on_skip_limit="take"
    )
    reads = []
    for batch in _stream(OVER):
        _backward(model, batch)
        with HostReadCounter() as counter:
            guard.step()
        reads.append(counter.count)
        opt.zero_grad()
    assert reads[1:] == [1 if sync else 0] * (len(OVER) - 1)


@pytest.mark.parametrize("sync", [True, False])
def test_raise_at_the_step_after_the_limit_or_at_the_next_check(sync):
    limit = 3
    first = _first_over_limit(OVER, limit)
    assert first == 8
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    guard = StepGuard(opt, threshold=THRESHOLD, sync=sync, max_consecutive_skips=limit)
    before = None
    with pytest.raises(SkipLimitError, match=r"4 steps in a row.*max_consecutive_skips=3") as info:
        for batch in _stream(OVER):
            _backward(model, batch)
            if guard.num_steps == first:
                before = copy.deepcopy(model.state_dict())
            guard.step()
            opt.zero_grad()
    # sync=True: at that step; sync=False: at the first check (every `limit` steps) after it
    expected_steps = first + 1 if sync else -(-(first + 1) // limit) * limit
    assert guard.num_steps == expected_steps
    assert "threshold=1.0" in str(info.value)
    if sync:  # the over-limit step itself was skipped: nothing changed
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_run_that_ends_before_the_check_is_still_reported_with_sync_false():
    """The old sync=False check looked at the run only every N steps, so runs of up to
    2N-2 skips that ended in between were never seen."""
    limit = 4
    over = [True] * 5 + [False] * 3 + [False] * 4  # a run of 5 in steps 0-4, over at step 4
    assert _first_over_limit(over, limit) == 4
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = StepGuard(opt, threshold=THRESHOLD, sync=False, max_consecutive_skips=limit)
    with pytest.raises(SkipLimitError):
        for batch in _stream(over):
            _backward(model, batch)
            guard.step()
            opt.zero_grad()
    assert guard.num_steps == 8  # the check after step 7; the run had ended at step 5


@pytest.mark.parametrize("sync", [True, False])
def test_a_callable_can_widen_the_threshold(sync):
    calls = []

    def widen(guard):
        calls.append(guard.num_steps)
        guard.threshold = guard.threshold * 1e6

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = StepGuard(
        opt, threshold=THRESHOLD, sync=sync, max_consecutive_skips=2, on_skip_limit=widen
    )
    for batch in _stream([True] * 8):
        _backward(model, batch)
        guard.step()
        opt.zero_grad()
    assert calls == ([3] if sync else [4])  # after step 2 (sync) / at the check after it
    assert guard.threshold == THRESHOLD * 1e6
    assert guard.taken == 8 - calls[0]  # every later step is within the wider threshold


@pytest.mark.parametrize("sync", [True, False])
def test_no_limit_by_default_and_a_kept_step_resets_the_run(sync):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = StepGuard(opt, threshold=0.0, sync=sync)
    assert guard.max_consecutive_skips is None
    for batch in _stream([True] * 12):
        _backward(model, batch)
        guard.step()
        opt.zero_grad()
    assert guard.skipped == guard.consecutive_skips == 12
    limited = StepGuard(opt, threshold=THRESHOLD, sync=sync, max_consecutive_skips=2)
    for batch in _stream([True, True, False, True, True, False, True, True]):
        _backward(model, batch)
        limited.step()
        opt.zero_grad()
    assert limited.skipped == 6 and limited.consecutive_skips == 2


def test_bad_limit_arguments_are_refused_before_anything_changes():
    opt = torch.optim.SGD(_model().parameters(), lr=0.01)
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="max_consecutive_skips"):
            StepGuard(opt, max_consecutive_skips=bad)
    with pytest.raises(ValueError, match="on_skip_limit"):
        StepGuard(opt, max_consecutive_skips=3, on_skip_limit="continue")
    assert not opt._optimizer_step_pre_hooks


def test_the_limit_survives_a_checkpoint():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = StepGuard(opt, threshold=THRESHOLD, max_consecutive_skips=3, on_skip_limit="take")
    for batch in _stream([True, True]):
        _backward(model, batch)
        guard.step()
        opt.zero_grad()
    resumed = StepGuard(opt, threshold=THRESHOLD, max_consecutive_skips=3, on_skip_limit="take")
    resumed.load_state_dict(guard.state_dict())
    assert resumed.consecutive_skips == 2
    decisions = []
    for batch in _stream([True, True]):
        _backward(model, batch)
        decisions.append(resumed.step().decision)
        opt.zero_grad()
    assert decisions == ["skipped", "clipped"]  # the 4th in a row is taken, clipped
