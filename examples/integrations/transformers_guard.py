"""gradlab in the Hugging Face Transformers Trainer: clip, skip, and the rates in its logs.

    pip install gradlab "transformers==5.24.0" "accelerate==1.15.0"
    python transformers_guard.py         # the CPU, a few seconds

GuardMixin wraps the Trainer's optimizer in the guard (create_optimizer), marks the
guard's skips for Accelerate so the scheduler does not advance on them, and adds the
guard's counters to every training log (Trainer.log): gradlab/clip_rate and
gradlab/skip_rate land in state.log_history, trainer_state.json and each report_to
integration. max_grad_norm=0: the guard clips (threshold=1.0 is the Trainer's
max_grad_norm=1.0, bit for bit, where the two sum the norm in the same order).
"""

import math
import tempfile

import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from gradlab.integrations.transformers import GuardMixin


class GuardedTrainer(GuardMixin, Trainer):  # or (GuardMixin, SFTTrainer), ...
    pass


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


class Samples(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.x[100, 3] = math.nan  # one bad sample: its step is skipped

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_grad_norm=0.0,  # the guard clips
            num_train_epochs=2,
            per_device_train_batch_size=16,
            learning_rate=1e-2,
            logging_steps=8,
            report_to="none",
            use_cpu=True,
        )
        trainer = GuardedTrainer(
            model=Regressor(),
            args=args,
            train_dataset=Samples(),
            guard=dict(mode="clip", threshold=1.0, skip_above=10.0),
        )
        trainer.train()
    guard = trainer.guard
    print(f"steps {guard.num_steps}: clipped {guard.clipped}, skipped {guard.skipped}")
    last = [row for row in trainer.state.log_history if "loss" in row][-1]
    print("last log:", {k: v for k, v in last.items() if k.startswith("gradlab/")})
    print("weights finite:", all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters()))
