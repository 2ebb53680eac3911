"""GPT-2 on WikiText, as the parent plans it: the model section, its checks and the training windows
the data holds (torch-free; the model and its data: repro.workloads.gpt2)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from repro.data import SYNTHETIC
from repro.recipe import Recipe
from repro.schema import AT_LEAST_1, FRACTION, RecipeError
from repro.workloads.plan import WorkloadPlan

TOKENIZER_VOCAB = {"bytes": 256, "gpt2": 50257}
SPLIT_FILES = {
    "wikitext-2": ("valid.txt", "test.txt"),  # smoke: train on validation, validate on test
    "wikitext-103": ("train.txt", "valid.txt"),
}


@dataclass
class GPT2Spec:
    n_layer: Annotated[int, AT_LEAST_1] = 24
    d_model: Annotated[int, AT_LEAST_1] = 1024
    n_head: Annotated[int, AT_LEAST_1] = 16
    seq_len: Annotated[int, AT_LEAST_1] = 1024
    tokenizer: Literal["bytes", "gpt2"] = "gpt2"
    dropout: Annotated[float, FRACTION] = 0.1

    @property
    def vocab_size(self) -> int:
        return TOKENIZER_VOCAB[self.tokenizer]


class GPT2Plan(WorkloadPlan):
    ModelSpec = GPT2Spec
    metric = "perplexity"
    higher_is_better = False
    supported_datasets = (*SPLIT_FILES, SYNTHETIC)

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        super().check(recipe, source)
        spec = recipe.model
        if spec.d_model % spec.n_head:
            raise RecipeError(source, "model.n_head", f"the heads must split d_model evenly: "
                              f"{spec.d_model} % {spec.n_head} = {spec.d_model % spec.n_head}")

    @classmethod
    def real_train_samples(cls, recipe: Recipe, data_dir: Path) -> int:
        """Windows of the training file's bytes: exact for the byte tokenizer, and an upper bound for
        GPT-2's, whose tokens are at least one byte each."""
        size = (data_dir / SPLIT_FILES[recipe.data.dataset][0]).stat().st_size
        return max(size - 1, 0) // recipe.model.seq_len
