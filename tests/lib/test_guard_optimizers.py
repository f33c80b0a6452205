"""Every torch.optim optimizer under StepGuard: a skip is a run that never saw the batch.

The references are runs of the bare optimizer on the stream without the bad batches, with
the same step hooks; the host-read counts are torch's own (a bare optimizer.step()) plus
the guard's documented reads.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradlab import StepGuard
from gradlab.step import snapshot_buffers
from gradlab.sync import HostReadCounter

optim = torch.optim

#: name -> (factory, host reads of a bare step per parameter with a gradient).
OPTIMIZERS = {
    "SGD": (lambda p: optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.1), 0),
    "SGD-nesterov": (lambda p: optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True), 0),
    "SGD-fused": (lambda p: optim.SGD(p, lr=0.05, momentum=0.9, fused=True), 0),
    "Adam": (lambda p: optim.Adam(p, lr=0.01, weight_decay=0.01), 1),
    "Adam-single-tensor": (lambda p: optim.Adam(p, lr=0.01, foreach=False), 1),
    "Adam-amsgrad": (lambda p: optim.Adam(p, lr=0.01, amsgrad=True), 1),
    "Adam-fused": (lambda p: optim.Adam(p, lr=0.01, fused=True), 0),
    "AdamW": (lambda p: optim.AdamW(p, lr=0.01, weight_decay=0.1), 1),
    "AdamW-fused": (lambda p: optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True), 0),
    "Adagrad": (lambda p: optim.Adagrad(p, lr=0.05), 1),
    "Adagrad-fused": (lambda p: optim.Adagrad(p, lr=0.05, fused=True), 0),
    "Adadelta": (lambda p: optim.Adadelta(p), 0),
    "Adafactor": (lambda p: optim.Adafactor(p, lr=0.01), 3),
    "Adamax": (lambda p: optim.Adamax(p, lr=0.01), 1),
    "ASGD": (lambda p: optim.ASGD(p, lr=0.05), 3),
    "NAdam": (lambda p: optim.NAdam(p, lr=0.01), 3),
    "RAdam": (lambda p: optim.RAdam(p, lr=0.01), 1),
    "RMSprop": (lambda p: optim.RMSprop(p, lr=0.01, momentum=0.5), 0),
    "Rprop": (lambda p: optim.Rprop(p, lr=0.01), 4),
    "Muon": (lambda p: optim.Muon(p, lr=0.02), 0),
}
#: Optimizers that create their state in __init__ rather than at the first step.
EAGER_STATE = {"Adagrad", "Adagrad-fused"}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    bias = name != "Muon"  # Muon takes 2-d parameters only
    return nn.Sequential(nn.Linear(5, 8, bias=bias), nn.Tanh(), nn.Linear(8, 2, bias=bias))


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def _bad(batch, kind: str):
    x, y = batch
    if kind == "big":
        return x, y * 1e4
    x = x.clone()
    x[0, 0] = math.nan
    return x, y


class _Hooks:
    """Pre/post step hooks that log their calls and keep an EMA of the parameters."""

    def __init__(self, opt):
        self.calls: list[str] = []
        self.ema = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
        opt.register_step_pre_hook(lambda o, a, k: self.calls.append("pre"))
        opt.register_step_post_hook(self._post)

    def _post(self, opt, args, kwargs):
        self.calls.append("post")
        params = [p for g in opt.param_groups for p in g["params"]]
        for e, p in zip(self.ema, params, strict=True):
            e.mul_(0.5).add_(p.detach(), alpha=0.5)


def _run(name, make, batches, guard_kwargs=None, hooks=False, closure_opt=False):
    model = _model(name)
    opt = make(model.parameters())
    log = _Hooks(opt) if hooks else None
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


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b or (a != a and b != b)  # NaN == NaN for Python floats


def _assert_identical(got, ref) -> None:
    for p, q in zip(got[0].parameters(), ref[0].parameters(), strict=True):
        assert torch.equal(p, q), "parameters differ"
    assert _same(got[1].state_dict(), ref[1].state_dict()), "optimizer state differs"
    if ref[2] is not None:
        assert got[2].calls == ref[2].calls, "step hooks fired on a skipped step"
        assert all(map(torch.equal, got[2].ema, ref[2].ema)), "an EMA hook saw a skipped step"


@pytest.mark.parametrize("hooks", [False, True], ids=["", "hooks"])
@pytest.mark.parametrize("mode", ["skip", "clip"])
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_skip_is_a_run_that_never_saw_the_batch(name, sync, mode, hooks):
    make = OPTIMIZERS[name][0]
    batches = _batches(6)
    kind = "big" if mode == "skip" else "nan"  # clip mode skips non-finite steps only
    stream = [_bad(batches[0], kind), *batches[1:3], _bad(batches[3], kind), *batches[4:]]
    ref = _run(name, make, [batches[i] for i in (1, 2, 4, 5)], hooks=hooks)
    threshold = 50.0 if mode == "skip" else 1e30
    got = _run(name, make, stream, dict(mode=mode, threshold=threshold, sync=sync), hooks)
    assert (got[3].skipped, got[3].taken) == (2, 4)
    _assert_identical(got, ref)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
def test_lbfgs_with_a_closure(sync):
    def make(p):
        return optim.LBFGS(p, lr=0.5, max_iter=4, history_size=3)

    batches = _batches(5)
    stream = [*batches[:2], _bad(batches[2], "big"), *batches[3:]]
    ref = _run("LBFGS", make, [*batches[:2], *batches[3:]], hooks=True, closure_opt=True)
    got = _run("LBFGS", make, stream, dict(threshold=50.0, sync=sync), True, closure_opt=True)
    assert got[3].skipped == 1
    assert got[3].last.output is not None  # the optimizer's return value (the loss)
    _assert_identical(got, ref)


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

    batches = _batches(6)
    stream = [*batches[:2], _bad(batches[2], "big"), _bad(batches[3], "nan"), *batches[4:]]
    ref = _run("nested", make, [*batches[:2], *batches[4:]])
    got = _run("nested", make, stream, dict(threshold=50.0, sync=sync))
    assert got[3].skipped == 2
    _assert_identical(got, ref)
    assert got[1].param_groups[0]["decay"].item() == pytest.approx(0.9**4)


@pytest.mark.parametrize("grow", [False, True], ids=["fixed", "growing"])
def test_nested_state_host_reads(grow):
    model = _model("nested")
    guard = StepGuard(_NestedState(model.parameters(), grow), threshold=50.0, sync=False)
    counts = []
    for x, y in _batches(4):
        nn.functional.mse_loss(model(x), y).backward()
        with HostReadCounter() as reads:
            guard.step()
        counts.append(reads.count)
        guard.optimizer.zero_grad()
    # A growing list cannot be undone by a select: the decision is read at every step.
    assert counts == ([1, 1, 1, 1] if grow else [1, 0, 0, 0])


# ------------------------------------------------------------------- host reads


def _count_reads(name, make, sync, steps=4, closure_opt=False):
    model = _model(name)
    opt = make(model.parameters())
    guard = None if sync is None else StepGuard(opt, threshold=1e9, sync=sync)
    counts = []
    for x, y in _batches(steps):

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
    k = len(list(_model(name).parameters()))
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
    batches = _batches(5)
    stream = [*batches[:2], _bad(batches[2], "big"), *batches[3:]]
    ref = _run(name, make, [*batches[:2], *batches[3:]])
    got = _run(name, make, stream, dict(threshold=50.0, sync=False))
    _assert_identical(got, ref)


def test_skipped_start_up_steps_each_read_once():
    """Until a step is kept there is no state, so each skipped start-up step reads once."""
    make = OPTIMIZERS["SGD"][0]  # no host read of its own
    batches = _batches(5)
    stream = [_bad(batches[0], "big"), _bad(batches[1], "nan"), *batches[2:]]
    model = _model("SGD")
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
    _assert_identical((model, guard.optimizer, None), ref)


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
    model = _model(name)
    guard = StepGuard(make(model.parameters()), threshold=50.0, sync=False)
    for i, (x, y) in enumerate(_batches(3)):
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
    for x, _ in _batches(4):
        frozen(torch.tanh(trained(x))).sum().backward()
        guard.step()
        opt.zero_grad()
        pointers.append([b.data_ptr() for b in snapshot_buffers(opt)])
    assert pointers[1] == pointers[2] == pointers[3]  # reused from the second step on
    n_trained = sum(p.numel() for p in trained.parameters())
    # The trained parameters, their exp_avg and exp_avg_sq, and one `step` each.
    assert sum(b.numel() for b in snapshot_buffers(opt)) == 3 * n_trained + 2
