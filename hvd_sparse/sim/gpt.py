"""A small GPT-style language model on the word corpus: the transformer task of the simulator.

What transformer users train, at a size two CPU cores can train many times: GPT-2's block
(pre-norm, causal multi-head self-attention, a 4x-wide GELU MLP, learned positions, a final norm
and a decoder tied to the token embedding) at 2 layers, 128 wide, on the word corpus that ships
with Python (``words.py``, its "tree" corpus). Weights start as GPT-2's: normal(0, 0.02), the
residual projections scaled by 1/sqrt(2 * layers), biases 0, norms 1. ``gpt_tf.keras_gpt`` builds
the same function in Keras from the same tensors (``weights_for_keras``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Sizes of the task's model: 0.93 M parameters, 56% of them in the tied embedding. A 4096-token
# vocabulary (the word corpus's most frequent tokens) keeps a rank's step near 40 ms on one core;
# at the corpus's 10 k the decoder alone triples it.
VOCAB_SIZE, WIDTH, LAYERS, HEADS, CONTEXT = 4096, 128, 2, 4, 64
CORPUS_SCOPE = "tree"   # the standard library's whole tree (words.py), read about once in a run
INIT_STD = 0.02


class Block(torch.nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.attn_proj = torch.nn.Linear(width, width)
        self.ln_2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.mlp_proj = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block on a batch of shape (batch, time, width)."""
        batch, time, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(attended.transpose(1, 2).reshape(batch, time, width))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm, the tied decoder."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, width: int = WIDTH, layers: int = LAYERS,
                 heads: int = HEADS, context: int = CONTEXT):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.context = context
        self.wte = torch.nn.Embedding(vocab_size, width)
        self.wpe = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.zeros_(param)
            elif ".ln_" in name or name.startswith("ln_"):
                torch.nn.init.ones_(param)
            else:
                scale = 1 / math.sqrt(2 * layers) if name.endswith("_proj.weight") else 1.0
                torch.nn.init.normal_(param, 0.0, INIT_STD * scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token scores (batch, time, vocab) of a batch of id sequences (batch, time)."""
        time = ids.shape[1]
        if time > self.context:
            raise ValueError(f"sequence of {time} tokens, the model's context is {self.context}")
        x = self.wte(ids) + self.wpe(torch.arange(time, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T


def gpt_model(seed: int = 0, vocab_size: int = VOCAB_SIZE, width: int = WIDTH,
              layers: int = LAYERS, heads: int = HEADS, context: int = CONTEXT) -> GPT:
    """The task's model, initialised from ``seed`` (the same weights for the same seed)."""
    torch.manual_seed(seed)
    return GPT(vocab_size, width, layers, heads, context)
