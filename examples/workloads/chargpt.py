"""A small GPT-style character model (Radford et al., 2019, after nanoGPT) and a text corpus
that needs no download: the Python standard library's own source files.

Characters are bytes (a vocabulary of 256), so the model does not depend on which files
a machine's Python ships. The corpus is read in a fixed order (sorted file names); the
last `val_fraction` of it is the validation text.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

VOCAB = 256


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, block: int = 128, layers: int = 4, dim: int = 128, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(block, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(dim, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if name.endswith("proj.weight") else 1.0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(positions))
        return self.head(self.ln(self.blocks(x)))  # (batch, time, vocab) logits


def gpt(block: int = 128, layers: int = 4, dim: int = 128, heads: int = 4, dropout: float = 0.1) -> CharGPT:
    return CharGPT(block, layers, dim, heads, dropout)


class Windows(Dataset):
    """Non-overlapping windows of `block` bytes; the target is the window shifted by one."""

    def __init__(self, tokens: torch.Tensor, block: int):
        self.tokens, self.block = tokens, block

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block
        chunk = self.tokens[start:start + self.block + 1].long()
        return chunk[:-1], chunk[1:]


def stdlib_corpus(chars: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        parts.append(data)
        size += len(data)
        if size >= chars:
            break
    return b"".join(parts)[:chars]


def stdlib_text(block: int = 128, chars: int = 2_000_000, val_fraction: float = 0.1) -> tuple[Windows, Windows]:
    """(train, val) windows over the first `chars` bytes of the standard library's sources."""
    tokens = torch.frombuffer(bytearray(stdlib_corpus(chars)), dtype=torch.uint8)
    split = int(len(tokens) * (1 - val_fraction))
    return Windows(tokens[:split], block), Windows(tokens[split:], block)
