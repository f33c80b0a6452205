"""gradlab.sync: the one detector of host reads catches every way of reading a value."""

import math

import pytest
import torch
from clip_helpers import make_params

import gradlab
from gradlab.sync import HostReadCounter, HostReadError, is_read_op, no_host_reads

T = torch.tensor([1.0, -2.0, 3.0])
MASK = T > 0


def _set_masked():
    g = T.clone()
    g[MASK] = 0.0


# (what is read, how, a word the name of the read must contain)
READS = [
    ("item", lambda: T[0].item(), "item"),
    ("float", lambda: float(T[0]), "float(t)"),
    ("int", lambda: int(T[0]), "int(t)"),
    ("bool", lambda: bool(T[0] > 0), "bool(t)"),
    ("if", lambda: 1 if T[0] > 0 else 0, "`if`"),
    ("tolist", lambda: T.tolist(), "tolist"),
    ("numpy", lambda: pytest.importorskip("numpy") and T.numpy(), "numpy"),
    ("__array__", lambda: pytest.importorskip("numpy").asarray(T), "__array__"),
    ("print", lambda: print(T), "printing"),
    ("repr", lambda: repr(T), "printing"),
    ("format", lambda: f"{T}", "formatting"),
    ("format-0-dim", lambda: f"{T[0]:.3f}", "formatting"),
    ("mask-get", lambda: T[MASK], "indexing t[...] (aten.index.Tensor with a boolean mask)"),
    ("mask-set", _set_masked, "assignment t[...] = ... (aten.index_put_.default with a boolean"),
    ("tensor-index", lambda: T[T.argmax()], "indexing t[...] (aten._local_scalar_dense"),
    ("nonzero", lambda: T.nonzero(), "nonzero"),
    ("torch.nonzero", lambda: torch.nonzero(T), "nonzero"),
    ("where-1-arg", lambda: torch.where(MASK), "torch.where"),
    ("masked_select", lambda: torch.masked_select(T, MASK), "masked_select"),
    ("unique", lambda: torch.unique(T), "unique"),
    ("Tensor.unique", lambda: T.unique(), "unique"),
    ("unique-dim", lambda: torch.unique(T, dim=0), "unique"),
    ("unique_consecutive", lambda: torch.unique_consecutive(T), "unique_consecutive"),
    ("equal", lambda: torch.equal(T, T), "torch.equal"),
    ("allclose", lambda: torch.allclose(T, T), "allclose"),
    ("Tensor.allclose", lambda: T.allclose(T), "allclose"),
    ("contains", lambda: 1.0 in T, "in t"),
]


@pytest.mark.parametrize(("what", "read", "word"), READS, ids=[r[0] for r in READS])
def test_every_read_counts_once_and_is_named(what, read, word, capsys):
    with HostReadCounter() as reads:
        read()
    assert reads.count == 1, reads.operations
    assert word in reads.operations[0]


@pytest.mark.parametrize(("what", "read", "word"), READS, ids=[r[0] for r in READS])
def test_no_host_reads_raises_naming_the_read(what, read, word, capsys):
    message = "reads a tensor value on the host"
    with pytest.raises(HostReadError, match=message) as raised, no_host_reads():
        read()
    assert word in str(raised.value)


def test_device_side_work_is_not_a_read():
    with HostReadCounter() as reads:
        torch.where(MASK, T, torch.zeros(()))
        T[torch.tensor([0, 2])] = T[torch.tensor([0, 2])]  # integer indices: no read
        T.clone()[0] = 5.0
        torch.clamp(T.sum() / 2, max=1.0) * T
        _ = T.shape, T.dtype, T.device, T.numel(), len(T)
    assert reads.count == 0, reads.operations


def test_several_reads_are_all_recorded_in_order():
    with HostReadCounter() as reads:
        T.tolist()
        torch.equal(T, T)
        T.sum().item()
    assert reads.count == 3
    assert ["tolist" in reads.operations[0], "equal" in reads.operations[1]] == [True, True]


def test_nested_counters_both_count():
    with HostReadCounter() as outer:
        with HostReadCounter() as inner:
            T.sum().item()
        T.tolist()
    assert (outer.count, inner.count) == (2, 1)


def test_leaving_restores_everything():
    with pytest.raises(HostReadError), no_host_reads():
        T.tolist()
    # Outside, reads work and are not seen by an exited counter.
    counter = HostReadCounter()
    with counter:
        pass
    assert T.tolist() == [1.0, -2.0, 3.0] and float(T[0]) == 1.0
    assert counter.count == 0


def test_is_read_op_is_the_dispatch_level_definition():
    aten = torch.ops.aten
    assert is_read_op(aten._local_scalar_dense.default)
    assert is_read_op(aten.index.Tensor, (T, [MASK]))
    assert not is_read_op(aten.index.Tensor, (T, [torch.tensor([0])]))
    assert not is_read_op(aten.add.Tensor, (T, T))


# ------------------------------------------------------------ gradlab reads nothing


def _mixed_params():
    params = make_params([(4, 3), (5,), (), (0,)], seed=3, scale=2.0)
    params += make_params([(3,)], dtype=torch.float16, seed=4)
    params += make_params([(2, 2)], dtype=torch.float64, seed=5)
    params[1].grad[0] = math.nan
    return params


@pytest.mark.parametrize("norm_type", [1, 2.0, 3.5, 100.0, math.inf])
@pytest.mark.parametrize("foreach", [None, False])
def test_gradlab_makes_no_host_read(norm_type, foreach):
    params = _mixed_params()
    grads = [p.grad for p in params]
    with HostReadCounter() as reads:
        total = gradlab.get_total_norm(grads, norm_type, foreach=foreach)
        gradlab.clip_grads_with_norm_(params, 1.0, total, foreach=foreach)
        gradlab.grad_ignore_with_norm_(params, torch.tensor(1.0), total, foreach=foreach)
        gradlab.clip_grad_norm_(params, 1.0, norm_type, foreach=foreach)
        gradlab.grad_ignore_norm_(params, 1.0, norm_type, foreach=foreach)
        gradlab.clip_grad_value_(params, 0.5, foreach=foreach)
        gradlab.clip_grad_value_(params, torch.tensor(0.5), foreach=foreach)
        gradlab.grad_ignore_value_(params, 0.5, foreach=foreach)
    assert reads.count == 0, reads.operations


def test_error_if_nonfinite_is_one_named_read():
    with HostReadCounter() as reads:
        gradlab.clip_grad_norm_(make_params([(3,)]), 1.0, error_if_nonfinite=True)
    assert reads.count == 1 and "item" in reads.operations[0]
