"""Seeds and determinism, in one place.

One master seed per recipe; every other seed is derived from it by purpose (and rank where a
stream must differ per rank), so two runs of one recipe draw the same numbers on every rank.
"""
from __future__ import annotations

import hashlib
import os
import random


def derive(master: int, purpose: str, rank: int | None = None) -> int:
    """A 63-bit seed for `purpose` (and `rank`), stable across Python versions and machines."""
    text = f"{master}/{purpose}" + ("" if rank is None else f"/{rank}")
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def seed_table(master: int, rank: int) -> dict[str, int]:
    """Every seed a rank uses, for the run record."""
    return {
        "model_init": derive(master, "model_init"),  # same weights on every rank and framework
        "data_order": derive(master, "data_order"),  # one global sample order, sliced per rank
        "rank_stream": derive(master, "rank_stream", rank),  # dropout and other per-rank noise
    }


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_deterministic(on_cuda: bool) -> None:
    """Deterministic kernels; on CUDA this also needs a cuBLAS workspace setting."""
    import torch

    if on_cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=on_cuda)
