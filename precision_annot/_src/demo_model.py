"""The small transformer the demo and the docs use, annotated three ways."""

from __future__ import annotations

import math

import torch
from torch import nn

from precision_annot._src.annotation import annotate, precision
from precision_annot._src.dtypes import bf16, fp32
from precision_annot._src.scope import precision_scope


@precision(fp32)  # 1. a decorator: every norm keeps fp32 parameters and computes in fp32
class Norm(nn.LayerNorm):
    pass


class FeedForward(nn.Module):
    """The feed-forward of a block, with T5's trouble planted: its hidden state runs `gain`
    times larger than its output. With gain 2**16 (exact in every dtype) the hidden state
    passes fp16's largest value, 65504, while the output stays moderate: fine in fp32 and bf16,
    non-finite in fp16."""

    def __init__(self, d: int, gain: float) -> None:
        super().__init__()
        self.wi = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.wo = nn.Linear(4 * d, d)
        self.gain = gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.wi(x)) * self.gain
        out: torch.Tensor = self.wo(hidden) / self.gain
        return out


class Block(nn.Module):
    def __init__(self, d: int, heads: int, gain: float = 2.0 ** 16) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = Norm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = Norm(d)
        self.mlp = FeedForward(d, gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v.transpose(1, 2)).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 4,
                 gain: float = 2.0 ** 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, gain) for _ in range(layers))
        self.norm = Norm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def build_model(vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 4) -> TinyTransformer:
    """The demo model: bf16 compute over fp32 storage, fp32 norms, an fp32 head with fp32 logits."""
    with precision_scope(compute=bf16, storage=fp32, comm=bf16):  # 2. a construction scope
        model = TinyTransformer(vocab, d, layers, heads)
    annotate(model, {"head": "compute=fp32,output=fp32"})  # 3. a rule by name
    return model
