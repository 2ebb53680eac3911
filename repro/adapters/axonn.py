"""AxoNN (PyPI `axonn`), the paper's authors' own framework: registered, but refused with its reason.

Checked with axonn 0.2.0 against torch 2.14.1: `axonn.init` calls `torch.cuda.set_device`
unconditionally and builds NCCL process groups, and its optimizer allocates CUDA streams and
buffers. On a machine without CUDA GPUs init fails ("Found no NVIDIA driver on your system").
Every equivalence test of this kit runs on CPU, so no AxoNN adapter is claimed (and the package is
not pinned) until one can be tested on GPUs.
"""
from __future__ import annotations

from repro.adapters.plan import FrameworkPlan
from repro.recipe import Recipe
from repro.schema import RecipeError

REASON = (
    "axonn 0.2.0 needs CUDA GPUs and NCCL (axonn.init calls torch.cuda.set_device), "
    "so this kit, tested on CPU, has no AxoNN adapter yet"
)


class AxoNNPlan(FrameworkPlan):
    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        raise RecipeError(source, "run.framework", REASON)
