"""The small GPT-style character model of the loss-spike chapter (book/adaptive/loss_spikes).

``experiments/char_lm_spikes.py`` trains it; the chapter builds one to show its
size. Token and position embeddings, pre-LN transformer blocks with causal
self-attention, a final LayerNorm and a linear head over :data:`ALPHABET` plus one
symbol for every other character.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ALPHABET", "Block", "CharGPT", "make_model"]

#: Printable ASCII and the newline; anything else becomes token 0.
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))


class Block(nn.Module):
    """A pre-LN transformer block: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Token and position embeddings, pre-LN blocks, a final LayerNorm, a linear head."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def make_model(seed: int, setup: dict) -> CharGPT:
    """The model of ``setup`` (keys context, width, layers, heads), initialised from
    ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return CharGPT(
        len(ALPHABET) + 1, setup["context"], setup["width"], setup["layers"], setup["heads"]
    )
