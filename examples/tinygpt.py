"""A small GPT and a byte-level data set built from the Python standard library's own sources.

Used by the demo (``examples/demo.py``) and the benchmarks::

    >>> from examples.tinygpt import GPT, StdlibText                     # doctest: +SKIP
    >>> data = StdlibText(max_bytes=2_000_000)                           # doctest: +SKIP
    >>> model = GPT(vocab_size=256, n_layer=4, n_head=4, d_model=128, block_size=128, dropout=0.1)  # doctest: +SKIP
    >>> gen = torch.Generator().manual_seed(0)                           # doctest: +SKIP
    >>> x, y = data.get_batch(8, 128, gen)                               # doctest: +SKIP
    >>> logits, loss = model(x, y)                                       # doctest: +SKIP

Everything here is deterministic: the model's initialisation draws from torch's global RNG (seed it first), the
data set is the sorted list of stdlib ``.py`` files, and batches are drawn from the ``torch.Generator`` passed in.
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "Block", "CausalSelfAttention", "StdlibText", "param_groups"]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    def __init__(self, n_head: int, d_model: int, block_size: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_head != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        # Not persistent: derived from block_size, so it is not part of the checkpointed state.
        self.register_buffer("mask", mask.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_head: int, d_model: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(n_head, d_model, block_size, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer: token embedding + learned positions, ``n_layer`` pre-LN blocks, final LayerNorm,
    and an output head tied to the token embedding (``head.weight is tok_emb.weight``)."""

    def __init__(self, vocab_size: int = 256, n_layer: int = 4, n_head: int = 4, d_model: int = 128,
                 block_size: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_head, d_model, block_size, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Distinct parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx``: (batch, time) int64 tokens. Returns logits (batch, time, vocab) and the mean cross-entropy
        against ``targets`` (None without targets)."""
        b, t = idx.shape
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: weight decay on matrices and embeddings (dim >= 2), none on biases and LayerNorm."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters() yields the tied weight once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class StdlibText:
    """Byte-level text (vocabulary 256) made of the standard library's ``.py`` files, concatenated in sorted path
    order up to ``max_bytes``. The last ``val_fraction`` is held out as the validation split.

    ``root`` defaults to ``sysconfig.get_paths()["stdlib"]``; ``site-packages``/``dist-packages`` are skipped,
    so installed third-party packages never change the text.
    """

    vocab_size = 256

    def __init__(self, max_bytes: int = 2_000_000, val_fraction: float = 0.05,
                 root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
        if not self.root.is_dir():
            raise FileNotFoundError(f"standard library sources not found at {self.root}")
        chunks: list[bytes] = []
        size = 0
        self.files: list[Path] = []
        for path in self._py_files():
            try:
                blob = path.read_bytes()
            except OSError:
                continue
            chunks.append(blob)
            self.files.append(path)
            size += len(blob)
            if size >= max_bytes:
                break
        text = b"".join(chunks)[:max_bytes]
        if len(text) < 4096:
            raise ValueError(f"only {len(text)} bytes of .py sources under {self.root}; need at least 4096")
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.long)
        n_val = max(1024, int(len(data) * val_fraction)) if val_fraction > 0 else 0
        self.train = data[: len(data) - n_val]
        self.val = data[len(data) - n_val:]

    def _py_files(self):
        skip = {"site-packages", "dist-packages", "__pycache__"}
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
            for name in sorted(filenames):
                if name.endswith(".py"):
                    yield Path(dirpath) / name

    def __len__(self) -> int:
        return len(self.train) + len(self.val)

    def __repr__(self) -> str:
        return (f"StdlibText({len(self)} bytes from {len(self.files)} files under {self.root}; "
                f"train {len(self.train)}, val {len(self.val)})")

    def get_batch(self, batch_size: int, block_size: int, generator: torch.Generator,
                  split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows: inputs (B, T) and next-byte targets (B, T), both int64. The offsets
        come only from ``generator``, so a seeded generator gives the same batches in the same order."""
        data = {"train": self.train, "val": self.val}[split]
        if len(data) <= block_size + 1:
            raise ValueError(f"{split} split has {len(data)} bytes; block_size {block_size} needs more")
        starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
        offsets = starts[:, None] + torch.arange(block_size + 1)
        window = data[offsets]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
