"""GPT-2 on WikiText, as a list of layers: embedding, transformer blocks, head (tied to the embedding).

The medium size is the published one (24 layers, 1024 hidden, 16 heads, 1024 context, vocabulary
50257, tied embeddings: 354,823,168 parameters). Initialisation follows GPT-2: N(0, 0.02), residual
projections scaled by 1/sqrt(2 * layers).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from repro.workloads.base import Workload
from repro.workloads.gpt2_plan import SPLIT_FILES, GPT2Plan, GPT2Spec


class Embedding(nn.Module):
    def __init__(self, spec: GPT2Spec):
        super().__init__()
        self.wte = nn.Embedding(spec.vocab_size, spec.d_model)
        self.wpe = nn.Embedding(spec.seq_len, spec.d_model)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(positions))


class Attention(nn.Module):
    def __init__(self, spec: GPT2Spec):
        super().__init__()
        self.n_head = spec.n_head
        self.c_attn = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.c_proj = nn.Linear(spec.d_model, spec.d_model)
        self.dropout = spec.dropout
        self.resid_drop = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(batch, seq, width)))


class MLP(nn.Module):
    def __init__(self, spec: GPT2Spec):
        super().__init__()
        self.c_fc = nn.Linear(spec.d_model, 4 * spec.d_model)
        self.c_proj = nn.Linear(4 * spec.d_model, spec.d_model)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, spec: GPT2Spec):
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.d_model)
        self.attn = Attention(spec)
        self.ln_2 = nn.LayerNorm(spec.d_model)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final layer norm and the output projection, whose weight is the token embedding's."""

    def __init__(self, spec: GPT2Spec, embedding: Embedding):
        super().__init__()
        self.ln_f = nn.LayerNorm(spec.d_model)
        self.weight = embedding.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln_f(x), self.weight)


def build_gpt2(spec: GPT2Spec) -> nn.Sequential:
    embedding = Embedding(spec)
    model = nn.Sequential(embedding, *(Block(spec) for _ in range(spec.n_layer)), Head(spec, embedding))
    for name, param in model.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(param, std=0.02 / math.sqrt(2 * spec.n_layer))
        elif param.dim() >= 2:
            nn.init.normal_(param, std=0.02)
        elif "ln" in name:
            nn.init.ones_(param) if name.endswith("weight") else nn.init.zeros_(param)
        else:
            nn.init.zeros_(param)
    return model


class TokenChunks(torch.utils.data.Dataset):
    """Non-overlapping windows of seq_len + 1 tokens: input is the first seq_len, target the last
    (the first `count` windows only, when given)."""

    def __init__(self, ids: torch.Tensor, seq_len: int, count: int | None = None):
        self.ids, self.seq_len = ids, seq_len
        windows = (len(ids) - 1) // seq_len
        self.count = windows if count is None else min(count, windows)
        # every window's input and target as a row of one 2-D view of the tokens (no copy)
        self.inputs = ids[: self.count * seq_len].view(self.count, seq_len)
        self.targets = ids[1 : self.count * seq_len + 1].view(self.count, seq_len)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]

    def collated(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """What `default_collate` makes of these windows, bit for bit, in two gathers instead of a
        slice per sample and a stack (repro.batches.InProcessBatches fetches through it)."""
        rows = torch.tensor(indices)
        return self.inputs[rows], self.targets[rows]


def tokenize(path: Path, tokenizer: str) -> torch.Tensor:
    text = path.read_text(encoding="utf-8")
    if tokenizer == "bytes":
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    from tokenizers import Tokenizer

    return torch.tensor(Tokenizer.from_pretrained("gpt2").encode(text).ids, dtype=torch.long)


class GPT2Workload(GPT2Plan, Workload):
    def build_model(self) -> nn.Sequential:
        return build_gpt2(self.spec)

    def random_samples(self, count: int, generator: torch.Generator) -> TokenChunks:
        ids = torch.randint(self.spec.vocab_size, (count * self.spec.seq_len + 1,), generator=generator)
        return TokenChunks(ids, self.spec.seq_len)

    def real_datasets(self) -> tuple[TokenChunks, TokenChunks]:
        train_file, val_file = SPLIT_FILES[self.data.dataset]
        seq_len, data = self.spec.seq_len, self.data
        train = TokenChunks(tokenize(self.data_dir / train_file, self.spec.tokenizer), seq_len, data.max_train_samples)
        val = TokenChunks(tokenize(self.data_dir / val_file, self.spec.tokenizer), seq_len, data.max_val_samples)
        return train, val

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))

    def _metric(self, loss: float, accuracy: float) -> dict[str, float]:
        return {"val/perplexity": math.exp(min(loss, 50.0))}

    def flops_per_sample(self) -> float:
        s = self.spec
        dense = 12 * s.n_layer * s.d_model**2 + s.vocab_size * s.d_model  # matmul weights per token
        attention = 2 * s.n_layer * s.seq_len * s.d_model  # scores and weighted sum per token
        return 6.0 * s.seq_len * (dense + attention)
