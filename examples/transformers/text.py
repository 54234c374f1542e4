"""Byte-level windows of a text for a language model, with no download: by default the Python
standard library's own sources (in a fixed order, so every machine with the same Python trains
on the same text), or any text file you name (`data.kwargs.path`).

Bytes are the tokens (a vocabulary of 256: `vocab_size: 256` in the model's config). The last
`val_fraction` of the text is the validation set.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


class Windows(Dataset):
    """Non-overlapping windows of `block` bytes. `shift`: the target is the next byte at each
    position (for a loss on the logits); else the window itself, for a model that shifts its
    labels itself (model.output: loss, as a transformers causal LM does)."""

    def __init__(self, tokens: torch.Tensor, block: int, shift: bool):
        self.tokens, self.block, self.shift = tokens, block, shift

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.block:(i + 1) * self.block + 1].long()
        return (chunk[:-1], chunk[1:]) if self.shift else (chunk[:-1], chunk[:-1])


def _stdlib_text(chars: int) -> bytes:
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        parts.append(path.read_bytes())
        size += len(parts[-1])
        if size >= chars:
            break
    return b"".join(parts)


def byte_windows(block: int = 64, chars: int = 500_000, val_fraction: float = 0.1, path: str | None = None,
                 shift: bool = True) -> tuple[Windows, Windows]:
    """(train, val) windows over the first `chars` bytes of `path` (default: the standard library's sources)."""
    text = (Path(path).read_bytes() if path else _stdlib_text(chars))[:chars]
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    split = int(len(tokens) * (1 - val_fraction))
    return Windows(tokens[:split], block, shift), Windows(tokens[split:], block, shift)


def random_tokens(block: int = 1024, vocab: int = 50257, samples: int = 256, val: int = 16, seed: int = 0):
    """(train, val) windows of uniformly random tokens: a language model's shapes and FLOPs with no
    text at all (bench/gpt2_bench.py times GPT-2 124M on them). TensorDatasets: on a GPU the
    trainer keeps them in device memory."""
    from torch.utils.data import TensorDataset

    tokens = torch.randint(vocab, (samples + val, block + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(tokens[:samples, :-1], tokens[:samples, 1:]), TensorDataset(tokens[samples:, :-1], tokens[samples:, 1:])
