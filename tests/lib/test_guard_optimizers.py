"""Every torch.optim optimizer under StepGuard: a skip is a run that never saw the batch.

The references are runs of the bare optimizer on the stream without the bad batches, with
the same step hooks; the host-read counts are torch's own (a bare optimizer.step()) plus
the guard's documented reads.
"""

from __future__ import annotations

import pytest
import torch
from optimizer_zoo import (
    EAGER_STATE,
    OPTIMIZERS,
    Hooks,
    assert_identical,
    batches_of,
    corrupt,
    model_for,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradlab import StepGuard
from gradlab.step import snapshot_buffers
from gradlab.sync import HostReadCounter

optim = torch.optim


def _run(name, make, batches, guard_kwargs=None, hooks=False, closure_opt=False):
    model = model_for(name)
    opt = make(model.parameters())
    log = Hooks(opt) if hooks else None
    guard = None if guard_kwargs is None else StepGuard(opt, **guard_kwargs)
    for x, y in batches:

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if closure_opt:
            (guard or opt).step(closure)
        else:
            closure()
            (guard or opt).step()
    return model, opt, log, guard


@pytest.mark.parametrize("hooks", [False, True], ids=["", "hooks"])
@pytest.mark.parametrize("mode", ["skip", "clip"])
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_skip_is_a_run_that_never_saw_the_batch(name, sync, mode, hooks):
    make = OPTIMIZERS[name][0]
    batches = batches_of(6)
    kind = "big" if mode == "skip" else "nan"  # clip mode skips non-finite steps only
    stream = [corrupt(batches[0], kind), *batches[1:3], corrupt(batches[3], kind), *batches[4:]]
    ref = _run(name, make, [batches[i] for i in (1, 2, 4, 5)], hooks=hooks)
    threshold = 50.0 if mode == "skip" else 1e30
    got = _run(name, make, stream, dict(mode=mode, threshold=threshold, sync=sync), hooks)
    assert (got[3].skipped, got[3].taken) == (2, 4)
    assert_identical(got, ref)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
def test_lbfgs_with_a_closure(sync):
    def make(p):
        return optim.LBFGS(p, lr=0.5, max_iter=4, history_size=3)

    batches = batches_of(5)
    stream = [*batches[:2], corrupt(batches[2], "big"), *batches[3:]]
    ref = _run("LBFGS", make, [*batches[:2], *batches[3:]], hooks=True, closure_opt=True)
    got = _run("LBFGS", make, stream, dict(threshold=50.0, sync=sync), True, closure_opt=True)
    assert got[3].skipped == 1
    assert got[3].last.output is not None  # the optimizer's return value (the loss)
    assert_identical(got, ref)


# -------------------------------------------------------- optimizers with nested state


class _NestedState(optim.Optimizer):
    """SGD with momentum kept in nested containers and a param-group tensor it updates."""

    def __init__(self, params, grow=False):
        super().__init__(params, {"lr": 0.1, "decay": torch.tensor(1.0)})
        self.grow = grow

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["decay"].mul_(0.9)  # a param-group tensor changed in place
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["bufs"] = [torch.zeros_like(p), {"sq": torch.zeros_like(p)}]
                    state["pair"] = (torch.zeros(()), torch.zeros(2))
                    state["seen"] = []
                buf, inner = state["bufs"]
                buf.mul_(0.9).add_(p.grad)
                inner["sq"].mul_(0.5).addcmul_(p.grad, p.grad)
                state["pair"][0].add_(1)
                state["pair"][1].add_(p.grad.sum())
                if self.grow:  # a list that grows: a change of structure
                    state["seen"].append(p.grad.norm())
                p.sub_(group["lr"] * group["decay"] * buf / (inner["sq"].sqrt() + 1))


@pytest.mark.parametrize("grow", [False, True], ids=["fixed", "growing"])
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
def test_nested_state_and_param_group_tensors_are_restored(sync, grow):
    def make(p):
        return _NestedState(p, grow=grow)

    batches = batches_of(6)
    stream = [*batches[:2], corrupt(batches[2], "big"), corrupt(batches[3], "nan"), *batches[4:]]
    ref = _run("nested", make, [*batches[:2], *batches[4:]])
    got = _run("nested", make, stream, dict(threshold=50.0, sync=sync))
    assert got[3].skipped == 2
    assert_identical(got, ref)
    assert got[1].param_groups[0]["decay"].item() == pytest.approx(0.9**4)


@pytest.mark.parametrize("grow", [False, True], ids=["fixed", "growing"])
def test_nested_state_host_reads(grow):
    model = model_for("nested")
    guard = StepGuard(_NestedState(model.parameters(), grow), threshold=50.0, sync=False)
    counts = []
    for x, y in batches_of(4):
        nn.functional.mse_loss(model(x), y).backward()
        with HostReadCounter() as reads:
            guard.step()
        counts.append(reads.count)
        guard.optimizer.zero_grad()
    # A growing list cannot be undone by a select: the decision is read at every step.
    assert counts == ([1, 1, 1, 1] if grow else [1, 0, 0, 0])


# ------------------------------------------------------------------- host reads


def _count_reads(name, make, sync, steps=4, closure_opt=False):
    model = model_for(name)
    opt = make(model.parameters())
    guard = None if sync is None else StepGuard(opt, threshold=1e9, sync=sync)
    counts = []
    for x, y in batches_of(steps):

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if not closure_opt:
            closure()
        with HostReadCounter() as reads:
            args = (closure,) if closure_opt else ()
            (opt if guard is None else guard).step(*args)
        counts.append(reads.count)
    return counts


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_host_reads_per_step(name):
    """The counts of the StepGuard docstring's table: torch's own reads, plus the guard's."""
    make, own_per_param = OPTIMIZERS[name]
    k = len(list(model_for(name).parameters()))
    own = own_per_param * k
    assert _count_reads(name, make, None) == [own] * 4  # the bare optimizer (torch)
    assert _count_reads(name, make, True) == [own + 1] * 4  # + the decision
    first = own if name in EAGER_STATE else own + 1  # + 1 on the step that creates state
    assert _count_reads(name, make, False) == [first, own, own, own]


def test_lbfgs_host_reads():
    def make(p):
        return optim.LBFGS(p, lr=0.5, max_iter=3)

    bare = _count_reads("LBFGS", make, None, closure_opt=True)
    assert _count_reads("LBFGS", make, True, closure_opt=True) == [n + 1 for n in bare]
    # LBFGS keeps Python numbers and growing lists in its state: one read per step.
    assert _count_reads("LBFGS", make, False, closure_opt=True) == [n + 1 for n in bare]


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_capturable_adam_makes_no_host_read(name, monkeypatch):
    """capturable=True keeps ``step`` on the device; allowed on CPU here to count reads."""
    import torch.optim.adam as adam_module

    monkeypatch.setattr(adam_module, "_get_capturable_supported_devices", lambda *a, **k: ["cpu"])
    cls = getattr(optim, name)

    def make(p):
        return cls(p, lr=0.01, capturable=True)

    assert _count_reads(name, make, None) == [0] * 4
    assert _count_reads(name, make, False) == [1, 0, 0, 0]
    batches = batches_of(5)
    stream = [*batches[:2], corrupt(batches[2], "big"), *batches[3:]]
    ref = _run(name, make, [*batches[:2], *batches[3:]])
    got = _run(name, make, stream, dict(threshold=50.0, sync=False))
    assert_identical(got, ref)


def test_skipped_start_up_steps_each_read_once():
    """Until a step is kept there is no state, so each skipped start-up step reads once."""
    make = OPTIMIZERS["SGD"][0]  # no host read of its own
    batches = batches_of(5)
    stream = [corrupt(batches[0], "big"), corrupt(batches[1], "nan"), *batches[2:]]
    model = model_for("SGD")
    guard = StepGuard(make(model.parameters()), threshold=50.0, sync=False)
    counts = []
    for x, y in stream:
        nn.functional.mse_loss(model(x), y).backward()
        with HostReadCounter() as reads:
            guard.step()
        counts.append(reads.count)
        guard.optimizer.zero_grad()
    assert counts == [1, 1, 1, 0, 0]
    ref = _run("SGD", make, batches[2:])
    assert_identical((model, guard.optimizer, None), ref)


# ----------------------------------------------------------------------- memory


class _Allocations(TorchDispatchMode):
    """The numel of every tensor an op allocates while active."""

    def __init__(self):
        super().__init__()
        self.numel: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name.startswith(("aten::empty", "aten::clone", "aten::zeros")):
            self.numel.append(out.numel())
        return out


@pytest.mark.parametrize("name", ["Adam-fused", "AdamW-fused", "SGD-fused", "Adagrad-fused"])
def test_fused_path_keeps_no_copy(name):
    make = OPTIMIZERS[name][0]
    model = model_for(name)
    guard = StepGuard(make(model.parameters()), threshold=50.0, sync=False)
    for i, (x, y) in enumerate(batches_of(3)):
        nn.functional.mse_loss(model(x), y).backward()
        with _Allocations() as alloc:
            guard.step()
        if i > 0:
            assert max(alloc.numel, default=0) <= 3  # a few scalars, no parameter copy
        guard.optimizer.zero_grad()


def test_snapshot_buffers_are_allocated_once_and_skip_frozen_parameters():
    torch.manual_seed(0)
    trained, frozen = nn.Linear(5, 8), nn.Linear(8, 2)
    for p in frozen.parameters():
        p.requires_grad_(False)
    opt = optim.Adam([*trained.parameters(), *frozen.parameters()], lr=0.01)
    guard = StepGuard(opt, threshold=50.0, sync=False)
    pointers = []
    for x, _ in batches_of(4):
        frozen(torch.tanh(trained(x))).sum().backward()
        guard.step()
        opt.zero_grad()
        pointers.append([b.data_ptr() for b in snapshot_buffers(opt)])
    assert pointers[1] == pointers[2] == pointers[3]  # reused from the second step on
    n_trained = sum(p.numel() for p in trained.parameters())
    # The trained parameters, their exp_avg and exp_avg_sq, and one `step` each.
    assert sum(b.numel() for b in snapshot_buffers(opt)) == 3 * n_trained + 2
