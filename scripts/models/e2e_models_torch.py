"""The PyTorch models of scripts/models/e2e_models.py (imported by it when a torch model is built; see
there for the models and their sizes)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .e2e_sizes import GPT


def legacy_model(name: str) -> nn.Module:
    """mlp25m, mlp7m and cnn exactly as scripts/workers/bench_e2e_worker.py built them (same modules in
    the same order, so the same seed-0 weights)."""
    if name in ("mlp25m", "mlp7m"):
        width = 2048 if name == "mlp25m" else 1024
        layers: list = [nn.Linear(1024, width), nn.ReLU()]
        for _ in range(5):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers += [nn.Linear(width, 1024), nn.ReLU(), nn.Linear(1024, 10)]
        return nn.Sequential(*layers)

    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]

    layers = [*block(3, 32), *block(32, 64), nn.MaxPool2d(2), *block(64, 128), *block(128, 128),
              nn.MaxPool2d(2), *block(128, 256), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
              nn.Linear(256, 10)]
    return nn.Sequential(*layers)


# --- ResNet (torchvision's layout) -------------------------------------------------------------
def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and the identity (or a 1x1 projection when the shape changes)."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        self.body = self.make_body(cin, planes, stride)
        out = planes * self.expansion
        self.shortcut = (nn.Sequential(*conv_bn(cin, out, 1, stride)) if stride != 1 or cin != out
                         else nn.Identity())

    @staticmethod
    def make_body(cin: int, planes: int, stride: int) -> nn.Module:
        return nn.Sequential(*conv_bn(cin, planes, 3, stride), nn.ReLU(inplace=True),
                             *conv_bn(planes, planes, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class Bottleneck(BasicBlock):
    """1x1 down, 3x3 (carrying the stride: ResNet v1.5), 1x1 up to 4x the planes."""

    expansion = 4

    @staticmethod
    def make_body(cin: int, planes: int, stride: int) -> nn.Module:
        return nn.Sequential(*conv_bn(cin, planes, 1), nn.ReLU(inplace=True),
                             *conv_bn(planes, planes, 3, stride), nn.ReLU(inplace=True),
                             *conv_bn(planes, planes * 4, 1))


def resnet(depth: int, classes: int = 1000) -> nn.Module:
    """ResNet-18 or ResNet-50 for ImageNet: 7x7 stem, max-pool, four stages, global average pool,
    fully connected classifier; convolutions He-initialised (fan-out), BatchNorm at 1 and 0."""
    block, counts = (BasicBlock, (2, 2, 2, 2)) if depth == 18 else (Bottleneck, (3, 4, 6, 3))
    layers: list[nn.Module] = [*conv_bn(3, 64, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for stage, count in enumerate(counts):
        planes = 64 * 2**stage
        for i in range(count):
            layers.append(block(cin, planes, 2 if stage > 0 and i == 0 else 1))
            cin = planes * block.expansion
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return model


# --- GPT -------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    """Multi-head self-attention, each position attending to itself and the ones before."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTModel(nn.Module):
    """Token and positional embeddings, the blocks, a final LayerNorm and the LM head (tied to the
    token embedding); logits (batch, sequence, vocabulary). GPT-2's initialisation: N(0, 0.02),
    the residual projections scaled by 1/sqrt(2 x layers), biases 0."""

    def __init__(self, layers: int, width: int, heads: int, vocab: int, context: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model(name: str, input_shape: tuple[int, ...], seed: int) -> nn.Module:
    """The model ``name`` from ``seed`` (``torch.manual_seed``: the global generator, as before)."""
    torch.manual_seed(seed)
    if name in ("mlp25m", "mlp7m", "cnn"):
        return legacy_model(name)
    if name in ("resnet18", "resnet50"):
        return resnet(int(name.removeprefix("resnet")))
    if name == "gpt":
        return GPTModel(**GPT)
    if name == "word-lstm":
        from hvd_sparse.sim.tasks import word_lstm_model

        return word_lstm_model(seed)
    if name == "word-gpt":
        from hvd_sparse.sim.gpt import gpt_model

        return gpt_model(seed)
    raise ValueError(f"unknown model {name!r}")
