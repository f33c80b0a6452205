"""gradlab in a Hugging Face Accelerate loop: one call replaces clip and step.

    pip install gradlab "accelerate==1.15.0"
    python accelerate_guard.py           # the CPU, a few seconds; or: accelerate launch ...

AcceleratedGuard guards the optimizer inside the prepared one. guard.step() replaces
accelerator.clip_grad_norm_(...) and optimizer.step(): it does nothing while gradients
accumulate, and on the last micro-batch it clips at 1, skips a step above 10 or with
NaN/inf exactly, updates Accelerate's GradScaler (mixed_precision="fp16" on a GPU) and
tells Accelerate the step was skipped, so the prepared scheduler does not advance.
"""

import math

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from gradlab.integrations import guard_metrics
from gradlab.integrations.accelerate import AcceleratedGuard


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    x[100, 3] = math.nan  # one bad sample: its optimizer step is skipped
    return DataLoader(TensorDataset(x, y), batch_size=16)


if __name__ == "__main__":
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=16)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, loader(), scheduler)
    guard = AcceleratedGuard(optimizer, mode="clip", threshold=1.0, skip_above=10.0)
    accelerator.register_for_checkpointing(guard)  # save_state / load_state keep its counters

    for _epoch in range(2):
        for x, y in data:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                record = guard.step()  # None while accumulating
                scheduler.step()  # Accelerate holds it back after a skipped step
                optimizer.zero_grad()
            if record is not None:
                accelerator.log(guard_metrics(guard), step=guard.num_steps)
                if record.decision == "skipped":
                    print(
                        f"step {record.step} skipped (norm {record.total_norm}); "
                        f"optimizer_step_was_skipped={accelerator.optimizer_step_was_skipped}"
                    )

    print(f"steps {guard.num_steps}: clipped {guard.clipped}, skipped {guard.skipped}")
    print("weights finite:", all(bool(torch.isfinite(p).all()) for p in model.parameters()))
