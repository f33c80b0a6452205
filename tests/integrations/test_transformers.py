"""gradlab inside the Hugging Face Transformers Trainer (transformers 5.24.0), on the CPU.

The data is an IterableDataset, so the Trainer reads the batches in order and a run
that meets a bad batch can be compared bit for bit with a run that never saw it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    any_nonfinite,
    assert_same_bits,
    batches,
    optimizer_state,
    params_of,
    poisoned,
    tiny_model,
)
from torch import nn
from torch.utils.data import IterableDataset
from transformers import Trainer, TrainingArguments

from gradlab.integrations import GUARD_STATE_KEY
from gradlab.integrations.transformers import GuardMixin

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

CLIP = dict(mode="clip", threshold=0.5, skip_above=50.0)


class GuardedTrainer(GuardMixin, Trainer):
    pass


class Regressor(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.net = tiny_model(bias=bias)

    def forward(self, x, labels):
        return {"loss": F.mse_loss(self.net(x), labels)}


class Samples(IterableDataset):
    """The samples of ``batches``, in order."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        for x, y in self.data:
            for i in range(len(x)):
                yield {"x": x[i], "labels": y[i]}


def arguments(tmp_path, steps, **overrides):
    options = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        max_steps=steps,
        learning_rate=1e-2,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    options.update(overrides)
    return TrainingArguments(**options)


def train(tmp_path, data, guard=CLIP, *, accum=1, resume=None, bias=True, **overrides):
    steps = len(data) // accum
    args = arguments(tmp_path, steps, gradient_accumulation_steps=accum, **overrides)
    model = Regressor(bias)
    if guard is None:
        trainer = Trainer(model=model, args=args, train_dataset=Samples(data))
    else:
        trainer = GuardedTrainer(model=model, args=args, train_dataset=Samples(data), guard=guard)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def state_of(trainer):
    return params_of(trainer.model), optimizer_state(trainer.optimizer.optimizer)


def test_tiny_model_trains(tmp_path):
    data = batches(8) * 6
    trainer = train(tmp_path, data)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert losses[-1] < 0.5 * losses[0]
    assert trainer.guard.taken == 48 == trainer.state.global_step


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("setup", ["adamw_torch", "adamw_torch_fused", "warmup", "accumulate"])
def test_bad_batch_skipped_exactly(tmp_path, setup, bad):
    clean = batches(8)
    options = {"optim": setup} if setup.startswith("adamw") else {}
    if setup == "warmup":  # the schedule moves every step: it must not move on the skip
        options = dict(lr_scheduler_type="constant_with_warmup", warmup_steps=10)
    accum = 2 if setup == "accumulate" else 1
    seen = [*clean[:2], clean[2], poisoned(clean[3], bad), *clean[4:]]
    never = [*clean[:2], *clean[4:]] if accum == 2 else [*clean[:3], *clean[4:]]
    a = train(tmp_path / "a", seen, accum=accum, **options)
    b = train(tmp_path / "b", never, accum=accum, **options)
    assert_same_bits(state_of(a), state_of(b))
    assert a.guard.skipped == 1
    if setup == "warmup":  # the learning rates of the steps taken are the same
        lrs_a = [r["learning_rate"] for r in a.state.log_history if "loss" in r]
        lrs_b = [r["learning_rate"] for r in b.state.log_history if "loss" in r]
        assert lrs_a[:3] + lrs_a[4:] == lrs_b

    control = train(tmp_path / "c", seen, guard=None, accum=accum, **options)
    assert any_nonfinite(control.model)


def test_the_warmup_test_can_fail(tmp_path):
    # Without the callback that marks the skip for Accelerate, the Trainer steps its
    # scheduler on the skipped batch and the runs part.
    clean = batches(5)
    options = dict(lr_scheduler_type="constant_with_warmup", warmup_steps=10)

    class Unmarked(GuardedTrainer):
        def add_callback(self, callback):
            if type(callback).__name__ != "_MarkSkipped":
                super().add_callback(callback)

    args = arguments(tmp_path / "a", 5, **options)
    a = Unmarked(
        model=Regressor(),
        args=args,
        train_dataset=Samples([*clean[:3], poisoned(clean[3]), clean[4]]),
        guard=CLIP,
    )
    a.train()
    b = train(tmp_path / "b", [*clean[:3], clean[4]], **options)
    assert not torch.equal(a.model.net[0].weight, b.model.net[0].weight)


@pytest.mark.parametrize("bias", [False, True], ids=["one-group", "two-groups"])
def test_clipping_matches_max_grad_norm(tmp_path, bias):
    data = batches(6, scale=3.0)  # every step clips
    own = train(tmp_path / "own", data, guard=None, max_grad_norm=0.5, bias=bias)
    ours = train(tmp_path / "ours", data, guard=dict(mode="clip", threshold=0.5), bias=bias)
    assert ours.guard.clipped == 6
    # The Trainer's grad_norm log is the norm the guard measured before clipping.
    own_norms = [r["grad_norm"] for r in own.state.log_history if "grad_norm" in r]
    our_norms = [r["gradlab/total_norm"] for r in ours.state.log_history if "loss" in r]
    if not bias:
        # The Trainer clips model.parameters() (Trainer._clip_grad_norm); the guard the
        # optimizer's parameters, by param group. Without biases, the Trainer's second
        # group (no weight decay) is empty and the orders agree: the same bits.
        assert our_norms == own_norms
        assert_same_bits(params_of(ours.model), params_of(own.model))
    else:
        # With biases the groups are (weights, biases), model.parameters() interleaves
        # them, and the norms are summed in another order: equal to the last bit or so.
        assert our_norms == pytest.approx(own_norms, rel=2**-22)
        for name, p in params_of(ours.model).items():
            torch.testing.assert_close(p, params_of(own.model)[name], rtol=1e-5, atol=1e-6)


def test_clip_and_skip_rates_in_the_trainers_logs(tmp_path):
    clean = batches(5)
    data = [clean[0], clean[1], poisoned(clean[2]), clean[3], (clean[4][0] * 30, clean[4][1] * 30)]
    trainer = train(tmp_path, data, save_strategy="steps", save_steps=5)
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["gradlab/skipped"] for r in rows] == [0, 0, 1, 1, 2]
    assert [r["gradlab/skip_rate"] for r in rows] == [0, 0, 1 / 3, 1 / 4, 2 / 5]
    assert rows[-1]["gradlab/clip_rate"] == rows[-1]["gradlab/clipped"] / 5
    assert math.isnan(rows[2]["gradlab/total_norm"]) and rows[4]["gradlab/total_norm"] > 50
    # ... and in the checkpoint's trainer_state.json, as the Trainer writes its logs.
    saved = json.loads(
        (tmp_path / "checkpoint-5" / "trainer_state.json").read_text(), parse_constant=float
    )
    assert [r["gradlab/skipped"] for r in saved["log_history"] if "loss" in r] == [0, 0, 1, 1, 2]


def test_checkpoint_and_resume_keep_the_guard(tmp_path):
    clean = batches(6)
    data = [clean[0], poisoned(clean[1]), *clean[2:]]
    guard = dict(mode="clip", threshold=0.5, max_consecutive_skips=3)
    straight = train(tmp_path / "straight", data, guard=guard)

    first = train(tmp_path / "run", data, guard=guard, save_strategy="steps", save_steps=3)
    ckpt = tmp_path / "run" / "checkpoint-3"
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)[GUARD_STATE_KEY]
    assert (saved["num_steps"], saved["counts"][2]) == (3, 1)
    assert first.guard.num_steps == 6

    resumed = train(tmp_path / "run", data, guard=guard, resume=str(ckpt))
    assert resumed.guard.state_dict() == straight.guard.state_dict()
    assert (resumed.guard.num_steps, resumed.guard.skipped) == (6, 1)
    assert_same_bits(state_of(resumed), state_of(straight))


def test_max_grad_norm_refused_where_it_would_hide_the_norm(tmp_path):
    args = arguments(tmp_path, 1, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0\) clips before the guard"):
        GuardedTrainer(model=Regressor(), args=args, train_dataset=Samples(batches(1)), guard=CLIP)
    # Skipping only non-finite steps works behind the Trainer's own clipping.
    clean = batches(3)
    trainer = GuardedTrainer(
        model=Regressor(),
        args=arguments(tmp_path, 3, max_grad_norm=1.0),
        train_dataset=Samples([clean[0], poisoned(clean[1]), clean[2]]),
        guard=dict(mode="skip", threshold=math.inf),
    )
    trainer.train()
    assert trainer.guard.skipped == 1 and not any_nonfinite(trainer.model)
