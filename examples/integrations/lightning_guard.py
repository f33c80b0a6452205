"""gradlab in PyTorch Lightning: clip at 1, skip above 10 or on NaN/inf, exactly.

    pip install gradlab "lightning==2.6.6"
    python lightning_guard.py            # the CPU, a few seconds

Lightning calls the optimizer itself, so configure_optimizers returns a
GuardedOptimizer: every step Lightning takes goes through the guard. Leave
Trainer(gradient_clip_val=...) unset: the guard clips (the same clipping, bit for bit).
The same module works with precision="bf16-mixed", with "16-mixed" on a GPU (Lightning
unscales before the guard; its GradScaler skips overflows itself) and with manual
optimization (opt.step() after self.manual_backward(loss)).
"""

import math

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gradlab
from gradlab.integrations import GuardedOptimizer
from gradlab.integrations.lightning import GuardCallback


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        guard = gradlab.StepGuard(optimizer, mode="clip", threshold=1.0, skip_above=10.0)
        guarded = GuardedOptimizer(
            guard
        )  # its step() is guard.step(); its state_dict holds the guard's
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(guarded, T_max=32)
        return {"optimizer": guarded, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric):
        if not self.trainer.optimizers[0].step_was_skipped:  # a skipped step keeps the schedule
            scheduler.step()


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    x[100, 3] = math.nan  # one bad sample: its batch (the 4th) is skipped, not stepped
    return DataLoader(TensorDataset(x, y), batch_size=16)


if __name__ == "__main__":
    model = Regressor()
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        callbacks=[GuardCallback()],  # logs gradlab/skipped, gradlab/clip_rate, ... per step
        log_every_n_steps=1,
        enable_progress_bar=False,
    )
    trainer.fit(model, loader())
    guard = trainer.optimizers[0].guard
    print(f"steps {guard.num_steps}: clipped {guard.clipped}, skipped {guard.skipped}")
    print("weights finite:", all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    print("metrics logged:", sorted(k for k in trainer.logged_metrics if k.startswith("gradlab/")))
