"""step_if_ on DTensor parameters (FSDP2's fully_shard), in a one-process gloo world.

The snapshot path copies and selects each DTensor through its local shard: torch's
foreach copy has no DTensor rule, so copying the DTensors themselves raised. The
reference is the same sharded model stepped on the stream without the rejected batches.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from optimizer_zoo import batches_of, corrupt
from torch import nn

from gradlab import step_if_

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is absent")


@pytest.fixture(scope="module", autouse=True)
def world(tmp_path_factory):
    path = tmp_path_factory.mktemp("world") / "init"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded_model():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    fully_shard(model)
    return model


def _keep(model):
    norm = torch.cat([p.grad.full_tensor().double().flatten() for p in model.parameters()]).norm()
    return torch.isfinite(norm) & (norm < 50.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=0.01, foreach=False),
        lambda p: torch.optim.AdamW(p, lr=0.01),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    ],
    ids=["adamw-for-loop", "adamw-foreach", "sgd-momentum"],
)
def test_a_rejected_step_of_dtensor_parameters_leaves_no_trace(make):
    batches = batches_of(6)
    stream = [corrupt(batches[0], "big"), *batches[1:3], corrupt(batches[3], "nan"), *batches[4:]]
    kept = [b for i, b in enumerate(batches) if i not in (0, 3)]

    def run(data, guarded):
        model = _sharded_model()
        opt = make(model.parameters())
        for x, y in data:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            step_if_(opt, _keep(model), sync=False) if guarded else opt.step()
        return model, opt

    model, opt = run(stream, True)
    ref, ref_opt = run(kept, False)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        for key, value in opt.state[p].items():
            other = ref_opt.state[q][key]
            local = value.to_local() if hasattr(value, "to_local") else value
            other = other.to_local() if hasattr(other, "to_local") else other
            assert torch.equal(local, other), key
