"""gradlab inside a Hugging Face Accelerate loop (accelerate 1.15.0), on the CPU.

Accelerate creates a GradScaler only for fp16 on an accelerator device
(``Accelerator.__init__``: ``mixed_precision == "fp16" and self.device.type != "cpu"``,
then ``self.native_amp = True`` and ``self.scaler = get_grad_scaler(...)``). The scaler
tests build ``Accelerator(mixed_precision="fp16", cpu=True)`` and do those two
assignments by hand with torch's CPU GradScaler: the scaler before ``prepare`` (so that
``prepare_optimizer`` gives it to the ``AcceleratedOptimizer`` and
``accelerator.backward`` scales the loss with it), ``native_amp`` after it (so that
``unscale_gradients`` and ``clip_grad_norm_`` unscale, and ``prepare_model`` adds no
float16 autocast). Accelerate's own scaler code then runs as on a GPU
(``AcceleratedOptimizer.step``, ``step_was_skipped``, ``AcceleratedScheduler.step``),
in float32 arithmetic: gradients scaled by a power of two unscale exactly, so a run
whose scaler backed off still matches a run that never saw the batch, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.tracking import GeneralTracker
from helpers import (
    any_nonfinite,
    assert_same_bits,
    batches,
    optimizer_state,
    params_of,
    poisoned,
    tiny_model,
)

from gradlab.integrations import guard_metrics
from gradlab.integrations.accelerate import AcceleratedGuard

CLIP = dict(mode="clip", threshold=0.5, skip_above=50.0)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    # Accelerate's states are process-wide singletons: one Accelerator per test.
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class ListTracker(GeneralTracker):
    """A tracker of Accelerate's own kind (accelerate/tracking.py), kept in a list."""

    name = "list"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def tracker(self):
        return self.rows

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        self.rows.append((step, dict(values)))


class Run:
    """One training run: the recipe (guard) or Accelerate's own loop (no guard)."""

    def __init__(
        self,
        guard=None,
        *,
        accum=1,
        scaler=False,
        schedule=False,
        fused=False,
        clip=None,
        tracker=None,
    ):
        self.accelerator = Accelerator(
            cpu=True,
            mixed_precision="fp16" if scaler else "no",
            gradient_accumulation_steps=accum,
            log_with=[tracker] if tracker else None,
        )
        if scaler:
            self.accelerator.scaler = torch.amp.GradScaler(
                "cpu", init_scale=2.0**10, growth_interval=10**6
            )
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8**s) if schedule else None
        prepared = self.accelerator.prepare(model, opt, *([sched] if sched else []))
        self.model, self.optimizer = prepared[:2]
        if scaler:
            self.accelerator.native_amp = True
        self.scheduler = prepared[2] if sched else None
        self.guard = None if guard is None else AcceleratedGuard(self.optimizer, **guard)
        if self.guard is not None:
            self.accelerator.register_for_checkpointing(self.guard)
        if tracker:
            self.accelerator.init_trackers("gradlab")
        self.clip = clip
        self.was_skipped: list[bool] = []
        self.steps = 0

    def train(self, data):
        acc = self.accelerator
        for x, y in data:
            with acc.accumulate(self.model):
                loss = F.mse_loss(self.model(x), y)
                acc.backward(loss)
                if self.guard is not None:
                    record = self.guard.step()
                else:  # Accelerate's own loop
                    record = None
                    if acc.sync_gradients and self.clip is not None:
                        acc.clip_grad_norm_(self.model.parameters(), self.clip)
                    self.optimizer.step()
                if self.scheduler is not None:
                    self.scheduler.step()
                self.optimizer.zero_grad()
            if acc.sync_gradients:
                self.was_skipped.append(acc.optimizer_step_was_skipped)
                if record is not None:
                    acc.log(guard_metrics(self.guard), step=self.steps)
                self.steps += 1
        return self

    def state(self):
        return params_of(self.model), optimizer_state(self.optimizer.optimizer)


def test_tiny_model_trains():
    data = batches(8)
    run = Run(CLIP)
    first = F.mse_loss(run.model(data[0][0]), data[0][1]).item()
    for _ in range(6):
        run.train(data)
    assert F.mse_loss(run.model(data[0][0]), data[0][1]).item() < 0.5 * first
    assert run.guard.taken == 48 and run.guard.clipped > 0


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("setup", ["fp32", "fused", "scaler", "schedule", "accumulate"])
def test_bad_batch_skipped_exactly(setup, bad):
    clean = batches(8)
    options = dict(
        scaler=setup == "scaler",
        schedule=setup == "schedule",
        fused=setup == "fused",
        accum=2 if setup == "accumulate" else 1,
    )
    if setup == "accumulate":  # a bad micro-batch spoils its whole optimizer step
        seen = [*clean[:2], clean[2], poisoned(clean[3], bad), *clean[4:]]
        never = [*clean[:2], *clean[4:]]
    else:
        seen = [*clean[:2], poisoned(clean[2], bad), *clean[3:]]
        never = [*clean[:2], *clean[3:]]
    a = Run(CLIP, **options).train(seen)
    b = Run(CLIP, **options).train(never)
    assert_same_bits(a.state(), b.state())
    # Accelerate's own flag, read after each optimizer step: true at the skipped one only.
    skipped_at = 1 if setup == "accumulate" else 2
    assert a.was_skipped == [i == skipped_at for i in range(len(a.was_skipped))]
    assert a.guard.skipped == 1
    if setup == "schedule":
        assert a.scheduler.get_last_lr() == b.scheduler.get_last_lr()
    if setup == "scaler":  # the overflow backed the scale off, once
        assert (
            a.accelerator.scaler.get_scale() == 2.0**9
            and b.accelerator.scaler.get_scale() == 2.0**10
        )

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    control = Run(None, clip=0.5, **options).train(seen)  # Accelerate's own loop
    if setup == "scaler":  # GradScaler's own skip is exact as well
        assert_same_bits(control.state(), Run(None, clip=0.5, **options).train(never).state())
        assert control.was_skipped[2]
    else:
        assert any_nonfinite(control.model)


def test_guard_skips_what_accelerate_would_take_and_scheduler_follows():
    # A finite step above skip_above: Accelerate's scaler sees nothing wrong; the guard
    # skips it, Accelerate reports it skipped, its scheduler does not advance, and the
    # scaler's scale does not back off.
    clean = batches(4)
    huge = (clean[2][0] * 30, clean[2][1] * 30)
    a = Run(CLIP, scaler=True, schedule=True).train([*clean[:2], huge, clean[3]])
    b = Run(CLIP, scaler=True, schedule=True).train([*clean[:2], clean[3]])
    assert a.was_skipped == [False, False, True, False]
    assert_same_bits(a.state(), b.state())
    assert a.scheduler.get_last_lr() == b.scheduler.get_last_lr()
    assert a.accelerator.scaler.get_scale() == 2.0**10


@pytest.mark.parametrize("scaler", [False, True], ids=["fp32", "scaler"])
def test_clipping_matches_accelerates_own(scaler):
    data = batches(6, scale=3.0)  # every step clips
    own = Run(None, clip=0.5, scaler=scaler).train(data)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    ours = Run(dict(mode="clip", threshold=0.5), scaler=scaler).train(data)
    assert ours.guard.clipped == 6
    assert_same_bits(ours.state(), own.state())


def test_decisions_in_accelerates_trackers():
    clean = batches(5)
    tracker = ListTracker()
    data = [clean[0], clean[1], poisoned(clean[2]), clean[3], (clean[4][0] * 30, clean[4][1] * 30)]
    Run(CLIP, tracker=tracker).train(data)
    assert [step for step, _ in tracker.rows] == [0, 1, 2, 3, 4]
    assert [row["gradlab/skipped"] for _, row in tracker.rows] == [0, 0, 1, 1, 2]
    assert math.isnan(tracker.rows[2][1]["gradlab/total_norm"])
    assert tracker.rows[-1][1]["gradlab/skip_rate"] == 2 / 5


def test_save_state_and_load_state_keep_the_guard(tmp_path):
    clean = batches(6)
    data = [clean[0], poisoned(clean[1]), *clean[2:]]
    guard = dict(mode="clip", threshold=0.5, max_consecutive_skips=3)
    straight = Run(guard).train(data[:3]).train(data[3:])
    expected = straight.state(), straight.guard.state_dict()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    first = Run(guard).train(data[:3])
    first.accelerator.save_state(str(tmp_path / "ckpt"))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    resumed = Run(guard)
    assert resumed.guard.num_steps == 0
    resumed.accelerator.load_state(str(tmp_path / "ckpt"))
    assert resumed.guard.state_dict() == first.guard.state_dict()
    assert resumed.guard.skipped == 1
    resumed.train(data[3:])
    assert_same_bits((resumed.state(), resumed.guard.state_dict()), expected)


def test_accumulating_microbatch_steps_nothing_and_stray_step_refused():
    run = Run(CLIP, accum=2, scaler=True)
    x, y = batches(1)[0]
    with run.accelerator.accumulate(run.model):
        run.accelerator.backward(F.mse_loss(run.model(x), y))
        assert run.guard.step() is None  # first micro-batch of two
    with run.accelerator.accumulate(run.model):
        run.accelerator.backward(F.mse_loss(run.model(x), y))
        with pytest.raises(RuntimeError, match="guarded by a StepGuard"):
            run.optimizer.step()  # Accelerate's step around the guard


def test_bad_arguments():
    run = Run()
    with pytest.raises(TypeError, match="AcceleratedOptimizer"):
        AcceleratedGuard(run.optimizer.optimizer)
    with pytest.raises(ValueError, match="sync=False"):
        AcceleratedGuard(run.optimizer, sync=False)
    with pytest.raises(ValueError, match="scaler"):
        AcceleratedGuard(run.optimizer, scaler=None)
