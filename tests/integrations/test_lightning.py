"""gradlab inside PyTorch Lightning's Trainer.fit (lightning 2.6.6), on the CPU.

Each exactness test compares a run that met a bad batch with a run that never saw it,
bit for bit: parameters and the optimizer's state (Adam's step counts included). A
control run without the guard shows that the bad batch does damage there.
"""

from __future__ import annotations

import csv
import math

import lightning.pytorch as L
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
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

import gradlab
from gradlab.integrations import GUARD_STATE_KEY, GuardedOptimizer
from gradlab.integrations.lightning import GuardCallback

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class Regressor(L.LightningModule):
    """The tiny model; the optimizer guarded when ``guard`` (StepGuard kwargs) is given."""

    def __init__(
        self,
        guard: dict | None = None,
        *,
        fused: bool = False,
        lr: float = 1e-2,
        manual: bool = False,
        schedule: bool = False,
        gradlab_clip: float | None = None,
        lbfgs: bool = False,
    ) -> None:
        super().__init__()
        self.net = tiny_model()
        self.guard_kwargs, self.fused, self.lr = guard, fused, lr
        self.schedule, self.gradlab_clip, self.lbfgs = schedule, gradlab_clip, lbfgs
        self.automatic_optimization = not manual
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()  # LightningOptimizer -> precision plugin -> GuardedOptimizer.step
        return loss

    def configure_optimizers(self):
        if self.lbfgs:
            inner = torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)
        else:
            inner = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.fused)
        opt = (
            inner
            if self.guard_kwargs is None
            else GuardedOptimizer(gradlab.StepGuard(inner, **self.guard_kwargs))
        )
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8**s)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric):
        # The recipe: a skipped step does not advance the schedule.
        if not getattr(self.trainer.optimizers[0], "step_was_skipped", False):
            scheduler.step()

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        if self.gradlab_clip is None:  # Lightning's own clipping (torch.nn.utils.clip_grad_norm_)
            return super().configure_gradient_clipping(
                optimizer, gradient_clip_val, gradient_clip_algorithm
            )
        # The clip-only recipe: the parameters Lightning clips (Precision.main_params).
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.norms.append(float(gradlab.clip_grad_norm_(params, self.gradlab_clip)))


def fit(module, data, ckpt_path=None, **kwargs):
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    trainer = L.Trainer(**options)
    trainer.fit(module, DataLoader(data, batch_size=None), ckpt_path=ckpt_path)
    return trainer


def fp16_plugin():
    # Lightning turns precision="16-mixed" into bf16 on the CPU (accelerator_connector.py,
    # _check_and_init_precision), but takes its own MixedPrecision plugin as given: the
    # same code as on a GPU (plugins/precision/amp.py), with torch's CPU GradScaler.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=10**6)
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


def state_of(module: Regressor, trainer: L.Trainer):
    return params_of(module), optimizer_state(trainer.optimizers[0])


CLIP = dict(mode="clip", threshold=0.5, skip_above=50.0)


def test_tiny_model_trains():
    data = batches(8)
    module = Regressor(CLIP, lr=3e-2)
    first = F.mse_loss(module.net(data[0][0]), data[0][1]).item()
    trainer = fit(module, data, max_epochs=6, callbacks=[GuardCallback()])
    guard = trainer.optimizers[0].guard
    last = F.mse_loss(module.net(data[0][0]), data[0][1]).item()
    assert last < 0.5 * first
    assert guard.num_steps == trainer.global_step == 48
    assert guard.taken == 48 and guard.clipped > 0


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize(
    "setup",
    ["32-true", "bf16-mixed", "manual", "fused", "schedule"],
)
def test_bad_batch_skipped_exactly(setup, bad):
    clean = batches(4)
    seen = [*clean[:2], poisoned(clean[2], bad), clean[3]]
    never = [*clean[:2], clean[3]]
    kwargs = dict(manual=setup == "manual", fused=setup == "fused", schedule=setup == "schedule")
    precision = "bf16-mixed" if setup == "bf16-mixed" else "32-true"

    a = Regressor(CLIP, **kwargs)
    ta = fit(a, seen, precision=precision, callbacks=[GuardCallback()])
    b = Regressor(CLIP, **kwargs)
    tb = fit(b, never, precision=precision, callbacks=[GuardCallback()])
    assert_same_bits(state_of(a, ta), state_of(b, tb))
    guard = ta.optimizers[0].guard
    assert (guard.num_steps, guard.skipped) == (4, 1)
    assert ta.global_step == 4  # Lightning counts the skipped step, as it does GradScaler's

    control = Regressor(None, **kwargs)  # the same run without the guard
    fit(control, seen, precision=precision)
    assert any_nonfinite(control.net)


def test_schedule_would_differ_without_the_recipe():
    # The schedule test above can fail: a scheduler stepped on the skipped batch moves
    # the learning rate, and the parameters part from the run that never saw it.
    clean = batches(4)
    seen = [*clean[:2], poisoned(clean[2]), clean[3]]

    class Plain(Regressor):
        def lr_scheduler_step(self, scheduler, metric):
            scheduler.step()

    a = Plain(CLIP, schedule=True)
    fit(a, seen, callbacks=[GuardCallback()])
    b = Regressor(CLIP, schedule=True)
    fit(b, [*clean[:2], clean[3]], callbacks=[GuardCallback()])
    assert not torch.equal(a.net[0].weight, b.net[0].weight)


def test_16_mixed_gradscaler_and_guard_skip_exactly():
    # An overflow: Lightning's GradScaler skips it before the guard is reached, and backs
    # off. A finite batch far above skip_above: the guard skips it; the scaler does not
    # back off. Both leave the parameters and the optimizer as before the batch.
    clean = batches(4)
    huge = (clean[2][0] * 10, clean[2][1] * 10)
    for bad, by in ((poisoned(clean[2], math.inf), "scaler"), (huge, "guard")):
        a, callback = Regressor(CLIP), GuardCallback()
        ta = fit(a, [*clean[:2], bad], plugins=[fp16_plugin()], callbacks=[callback])
        b = Regressor(CLIP)
        tb = fit(b, clean[:2], plugins=[fp16_plugin()], callbacks=[GuardCallback()])
        assert_same_bits(state_of(a, ta), state_of(b, tb))
        guard, scaler = ta.optimizers[0].guard, ta.precision_plugin.scaler
        assert ta.optimizers[0].step_was_skipped
        if by == "scaler":
            assert (guard.num_steps, callback.amp_skipped) == (2, [1])
            assert scaler.get_scale() == 2.0**3  # backed off once
        else:
            assert (guard.num_steps, guard.skipped, callback.amp_skipped) == (3, 1, [0])
            assert guard.last.total_norm > CLIP["skip_above"]
            assert scaler.get_scale() == 2.0**4


def test_16_mixed_trains_and_unscales_before_the_guard():
    data = batches(6)
    module = Regressor(dict(mode="none"))  # records the norm, always steps
    trainer = fit(module, data, plugins=[fp16_plugin()])
    record = trainer.optimizers[0].guard.last
    # The guard saw unscaled gradients: the same norm as a float32 backward within
    # float16's rounding, not 2**4 times it.
    reference = Regressor(dict(mode="none"))
    fit(reference, data)
    ref = reference.trainer.optimizers[0].guard.last.total_norm
    assert record.total_norm == pytest.approx(ref, rel=0.05)


@pytest.mark.parametrize("how", ["configure_gradient_clipping", "guard"])
def test_clipping_matches_lightnings_own(how):
    data = batches(6, scale=3.0)  # norms well above 0.5: every step clips
    own = Regressor()
    fit(own, data, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
    if how == "guard":
        ours = Regressor(dict(mode="clip", threshold=0.5))
        trainer = fit(ours, data, callbacks=[GuardCallback()])
        assert trainer.optimizers[0].guard.clipped == 6
    else:
        ours = Regressor(gradlab_clip=0.5)
        fit(ours, data)
        assert min(ours.norms) > 0.5
    assert_same_bits(params_of(ours), params_of(own))


def test_decisions_in_lightnings_logs(tmp_path):
    clean = batches(5)
    data = [
        clean[0],
        clean[1],
        poisoned(clean[2]),
        clean[3],
        (clean[4][0] * 1e3, clean[4][1] * 1e3),
    ]
    module = Regressor(CLIP)
    fit(
        module,
        data,
        logger=CSVLogger(tmp_path, name="run"),
        log_every_n_steps=1,
        callbacks=[GuardCallback()],
    )
    with open(next(tmp_path.glob("run/*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["gradlab/skipped"]) for r in rows] == [0, 0, 1, 1, 2]
    assert [float(r["gradlab/consecutive_skips"]) for r in rows] == [0, 0, 1, 0, 1]
    assert math.isnan(float(rows[2]["gradlab/total_norm"]))
    assert float(rows[4]["gradlab/total_norm"]) > 50.0
    assert float(rows[-1]["gradlab/skip_rate"]) == pytest.approx(2 / 5)
    # Lightning logs float32 values.
    assert float(rows[-1]["gradlab/clip_rate"]) == pytest.approx(
        float(rows[-1]["gradlab/clipped"]) / 5
    )


def test_checkpoint_and_resume_keep_the_guard(tmp_path):
    clean = batches(4)
    data = [clean[0], poisoned(clean[1]), clean[2], clean[3]]
    guard = dict(mode="clip", threshold=0.5, max_consecutive_skips=3)
    straight = Regressor(guard)
    ts = fit(straight, data, max_epochs=2, callbacks=[GuardCallback()])

    first = Regressor(guard)
    fit(
        first,
        data,
        max_epochs=1,
        callbacks=[GuardCallback()],
        default_root_dir=tmp_path,
        enable_checkpointing=True,
    )
    ckpt = next(tmp_path.glob("**/*.ckpt"))
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0][GUARD_STATE_KEY]
    assert saved["counts"][2] == 1 and saved["num_steps"] == 4

    resumed, callback = Regressor(guard), GuardCallback()
    tr = fit(resumed, data, max_epochs=2, callbacks=[callback], ckpt_path=str(ckpt))
    g_s, g_r = ts.optimizers[0].guard, tr.optimizers[0].guard
    assert g_r.state_dict() == g_s.state_dict()
    assert (g_r.num_steps, g_r.skipped) == (8, 2)
    assert_same_bits(state_of(resumed, tr), state_of(straight, ts))


def test_lbfgs_evaluates_the_closure_again():
    # LBFGS calls Lightning's closure (training_step, backward) several times a step:
    # through the guard it gets fresh evaluations, as without it.
    data = batches(3)
    plain = Regressor(lbfgs=True)
    fit(plain, data)
    guarded = Regressor(dict(mode="clip", threshold=1e9), lbfgs=True)
    trainer = fit(guarded, data, callbacks=[GuardCallback()])
    assert trainer.optimizers[0].guard.taken == 3
    assert_same_bits(params_of(guarded), params_of(plain))
    assert not torch.equal(params_of(plain)["net.0.weight"], params_of(Regressor())["net.0.weight"])


def test_refuses_lightning_clipping_before_the_guard():
    with pytest.raises(ValueError, match=r"gradient_clip_val=0\.5"):
        fit(Regressor(CLIP), batches(2), gradient_clip_val=0.5, callbacks=[GuardCallback()])
    with pytest.raises(ValueError, match="no optimizer is a gradlab GuardedOptimizer"):
        fit(Regressor(), batches(2), callbacks=[GuardCallback()])
