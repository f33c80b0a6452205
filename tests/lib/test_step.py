"""step_if_: a step whose keep is false is a run that never saw the batch, on every optimizer.

The keep decision here is made independently of gradlab (a float64 norm of the gradients
against a threshold), and the reference is the bare optimizer run on the stream without
the batches that keep rejects: parameters, every state tensor, the step counts and the
param groups must be the same bits, and no step hook may have fired for them.
"""

from __future__ import annotations

import math

import pytest
import torch
from optimizer_zoo import OPTIMIZERS, Hooks, assert_identical, batches_of, corrupt, model_for
from torch import nn

from gradlab import step_if_
from gradlab.step import snapshot_buffers
from gradlab.sync import HostReadCounter

THRESHOLD = 50.0


def _keep(model, device_bool: bool = True):
    """The independent rule: the float64 norm of the gradients is finite and below 50."""
    norm = torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm()
    keep = torch.isfinite(norm) & (norm < THRESHOLD)
    return keep if device_bool else bool(keep)


def _run(name, batches, *, sync=None, hooks=False, python_bool=False, closure_opt=False):
    """Run the optimizer over ``batches``; with ``sync`` given, step through step_if_."""
    model = model_for(name)
    opt = OPTIMIZERS[name][0](model.parameters())
    log = Hooks(opt) if hooks else None
    for x, y in batches:

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        closure()
        if sync is None:
            opt.step(closure) if closure_opt else opt.step()
        else:
            keep = _keep(model, not python_bool)
            step_if_(opt, keep, closure if closure_opt else None, sync=sync)
    return model, opt, log


def _host_reads_per_step(model, opt, batches, sync):
    """Train through step_if_ with the independent keep; the host reads each step_if_
    call made (the backward pass and the keep decision are outside the count)."""
    counts = []
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        keep = _keep(model)
        with HostReadCounter() as counter:
            step_if_(opt, keep, sync=sync)
        counts.append(counter.count)
    return counts


STREAM = ("big", None, None, "nan", None, "big")  # the first step is skipped: no state yet


def _streams():
    batches = batches_of(len(STREAM))
    stream = [
        b if kind is None else corrupt(b, kind) for b, kind in zip(batches, STREAM, strict=True)
    ]
    kept = [b for b, kind in zip(batches, STREAM, strict=True) if kind is None]
    return stream, kept


@pytest.mark.parametrize("hooks", [False, True], ids=["", "hooks"])
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_rejected_step_is_a_run_that_never_saw_the_batch(name, sync, hooks):
    stream, kept = _streams()
    ref = _run(name, kept, hooks=hooks)
    got = _run(name, stream, sync=sync, hooks=hooks)
    assert_identical(got, ref)


@pytest.mark.parametrize("name", ["SGD", "AdamW", "AdamW-fused"])
def test_a_python_bool_reads_nothing_and_decides_alike(name):
    stream, kept = _streams()
    assert_identical(_run(name, stream, sync=False, python_bool=True), _run(name, kept))


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
def test_lbfgs_with_a_closure(sync):
    name = "LBFGS"
    OPTIMIZERS.setdefault(name, (lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=3), 0))
    stream, kept = _streams()
    ref = _run(name, kept, closure_opt=True)
    got = _run(name, stream, sync=sync, closure_opt=True)
    assert_identical(got, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("name", ["SGD", "AdamW", "AdamW-fused"])
def test_other_parameter_dtypes(name, dtype):
    """16-bit and float64 parameters: the select works on their bits (NaN payloads too)."""
    stream, kept = _streams()

    def run(batches, guarded):
        model = model_for(name).to(dtype)
        opt = OPTIMIZERS[name][0](model.parameters())
        if "eps" in opt.defaults and dtype == torch.float16:
            opt.param_groups[0]["eps"] = 1e-4  # Adam's 1e-8 is 0 in float16: NaN steps
        for x, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
            if guarded:
                step_if_(opt, _keep(model), sync=False)
            else:
                opt.step()
        return model, opt, None

    assert_identical(run(stream, True), run(kept, False))


def test_fused_found_inf_is_set_for_the_call_only():
    model = model_for("AdamW-fused")
    opt = OPTIMIZERS["AdamW-fused"][0](model.parameters())
    x, y = batches_of(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    step_if_(opt, torch.tensor(True), sync=False)
    assert "found_inf" not in vars(opt)
    own = torch.zeros(())
    opt.found_inf = own  # someone else's (a GradScaler mid-step, say) is put back
    step_if_(opt, torch.tensor(False), sync=False)
    assert opt.found_inf is own
    del opt.found_inf
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # a later bare step is not skipped
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("name", "reads"),
    [("SGD", [1, 1, 1]), ("AdamW-fused", [1, 1, 1]), ("AdamW", [5, 5, 5])],
)
@pytest.mark.parametrize("sync", [True, False], ids=["sync", "nosync"])
def test_host_reads_are_the_documented_ones(name, reads, sync):
    """sync=True: one read (plus the optimizer's own: AdamW's CPU step tensors, one per
    parameter); sync=False: none but the optimizer's own, after the first step."""
    model = model_for(name)
    opt = OPTIMIZERS[name][0](model.parameters())
    counts = _host_reads_per_step(model, opt, batches_of(4), sync)
    expected = reads if sync else [n - 1 for n in reads]
    assert counts[1:] == expected


def test_the_snapshot_is_made_once_and_holds_what_the_step_changes():
    model = model_for("AdamW")
    opt = OPTIMIZERS["AdamW"][0](model.parameters())
    pointers = []
    for x, y in batches_of(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        step_if_(opt, _keep(model), sync=False)
        pointers.append([b.data_ptr() for b in snapshot_buffers(opt)])
    assert pointers[1] == pointers[2] == pointers[3]
    n = sum(p.numel() for p in model.parameters())
    k = len(list(model.parameters()))
    assert sum(b.numel() for b in snapshot_buffers(opt)) == 3 * n + k  # p, m, v, step


class _Failing(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        raise RuntimeError("boom")


def test_a_step_that_raises_leaves_everything_as_it_was():
    model = model_for("SGD")
    opt = _Failing(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batches_of(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="boom"):
        step_if_(opt, torch.tensor(True), sync=False)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert not opt.state


def test_bad_arguments_are_refused_before_anything_changes():
    model = model_for("SGD")
    opt = OPTIMIZERS["SGD"][0](model.parameters())
    x, y = batches_of(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    for bad in (torch.tensor([True]), torch.tensor(1.0), torch.tensor(1), 1, None, "yes"):
        with pytest.raises(ValueError, match=r"keep must be a 0-dim torch\.bool"):
            step_if_(opt, bad)
    with pytest.raises(TypeError, match="optimizer"):
        step_if_(model, torch.tensor(True))
    with pytest.raises(ValueError, match="closure"):
        step_if_(opt, torch.tensor(True), closure=1.0)
    with pytest.raises(ValueError, match="sync"):
        step_if_(opt, torch.tensor(True), sync=None)
    emb = nn.Embedding(4, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(ValueError, match="SparseAdam"):
        step_if_(torch.optim.SparseAdam(emb.parameters()), torch.tensor(False), sync=False)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert not opt.state


def test_nan_keep_is_impossible_and_a_nan_gradient_is_rejected_exactly():
    """A NaN gradient with keep false: the select works on bits, so neither NaN nor a
    multiplication by 0 reaches the parameters or the moments."""
    model = model_for("AdamW")
    opt = OPTIMIZERS["AdamW"][0](model.parameters())
    x, y = batches_of(1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    step_if_(opt, torch.tensor(True), sync=False)
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    params = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad.fill_(math.nan)
    step_if_(opt, torch.tensor(False), sync=False)
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    after = opt.state_dict()["state"]
    assert all(torch.equal(before[k][n], after[k][n]) for k in before for n in before[k])


class _Container(torch.optim.Optimizer):
    """One optimizer per model part, stepped together and holding no state of its own,
    as torchtitan's OptimizersContainer does."""

    def __init__(self, optimizers):
        self.optimizers = optimizers
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "snapshot"])
def test_a_container_of_optimizers_skips_every_part(fused):
    """The container's own state is empty: snapshotting it alone restored the parameters
    but let the parts' Adam moments and step counts move."""

    def run(batches, guarded):
        model = model_for("AdamW")
        first, _, second = model.children()
        parts = [
            torch.optim.AdamW(m.parameters(), lr=0.01, fused=fused or None) for m in (first, second)
        ]
        opt = _Container(parts)
        for x, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            step_if_(opt, _keep(model), sync=False) if guarded else opt.step()
        return model, parts

    stream, kept = _streams()
    model, parts = run(stream, True)
    ref_model, ref_parts = run(kept, False)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(p, q)
    for a, b in zip(parts, ref_parts, strict=True):
        assert_identical((nn.Module(), a, None), (nn.Module(), b, None))


def test_fused_in_every_param_group_is_taken_as_fused():
    """torchtitan builds its optimizers with fused=True in each param group: the same
    kernels, which honour found_inf, so no copy and no host read is needed."""
    model = model_for("AdamW")
    group = {"params": list(model.parameters()), "fused": True}
    opt = torch.optim.AdamW([group], lr=0.01, weight_decay=0.1)  # as OPTIMIZERS["AdamW-fused"]
    assert not getattr(opt, "_step_supports_amp_scaling", False)
    stream, kept = _streams()
    reads = _host_reads_per_step(model, opt, stream, sync=False)
    assert snapshot_buffers(opt) == []  # the fused path: nothing copied
    assert reads[2:] == [0] * (len(stream) - 2)  # after the first taken step
    ref = _run("AdamW-fused", kept)
    for p, q in zip(model.parameters(), ref[0].parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "for-loop"])
def test_a_parameter_first_stepped_in_a_skipped_step_gets_no_state(fused):
    """Once every parameter has state, a later one (a gradient it lacked, a new param
    group) still leaves a skipped step without state, as if the step never came."""
    a, b, c = (nn.Parameter(torch.full((3,), float(i))) for i in (1, 2, 3))
    opt = torch.optim.AdamW([a, b], lr=0.1, fused=fused, foreach=None if fused else False)
    a.grad = torch.ones(3)
    step_if_(opt, torch.tensor(True), sync=False)  # b has no gradient: no state for it
    kept = {k: v.clone() for k, v in opt.state[a].items()}
    b.grad = torch.ones(3)
    step_if_(opt, torch.tensor(False), sync=False)
    assert b not in opt.state or not opt.state[b]
    step_if_(opt, torch.tensor(True), sync=False)  # now both have state
    assert opt.state[b]
    before = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in (a, b)}
    opt.add_param_group({"params": [c]})
    c.grad = torch.ones(3)
    step_if_(opt, torch.tensor(False), sync=False)
    assert c not in opt.state or not opt.state[c]
    for p in (a, b):
        assert all(torch.equal(v, before[p][k]) for k, v in opt.state[p].items())
    assert kept.keys() == before[a].keys()


def test_step_if_inside_a_compiled_function_still_skips_exactly():
    """Under torch.compile step_if_ runs eagerly (a graph break): the skip is exact."""
    model = model_for("AdamW-fused")
    opt = OPTIMIZERS["AdamW-fused"][0](model.parameters())
    ref = model_for("AdamW-fused")
    ref_opt = OPTIMIZERS["AdamW-fused"][0](ref.parameters())
    stream, kept = _streams()

    def train_step(m, o):
        grads = [p.grad for p in m.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        return step_if_(o, torch.isfinite(norm) & (norm < THRESHOLD), sync=False)

    torch._dynamo.reset()
    compiled = torch.compile(train_step, backend="eager")
    for x, y in stream:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        compiled(model, opt)
    torch._dynamo.reset()
    for x, y in kept:
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    assert_identical((model, opt, None), (ref, ref_opt, None))
    assert not hasattr(opt, "found_inf")
