"""Model definitions: the published sizes, and layer lists that pipelines can partition."""
from __future__ import annotations

import pytest
import torch
import torchvision

from repro.workloads.gpt2 import GPT2Spec, build_gpt2
from repro.workloads.vgg16 import VGG16Spec, build_vgg16

pytestmark = pytest.mark.units


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_vgg16_paper_size_is_torchvisions() -> None:
    with torch.device("meta"):
        ours, theirs = build_vgg16(VGG16Spec(), 1000), torchvision.models.vgg16()
    assert count(ours) == count(theirs) == 138_357_544
    assert [p.shape for p in ours.parameters()] == [p.shape for p in theirs.parameters()]


def test_gpt2_medium_has_the_published_parameter_count() -> None:
    with torch.device("meta"):
        model = build_gpt2(GPT2Spec())
    assert count(model) == 354_823_168
    assert len(model) == 26  # embedding, 24 blocks, head
    assert model[-1].weight is model[0].wte.weight  # tied embeddings


def test_smoke_models_run_forward() -> None:
    torch.manual_seed(0)
    gpt = build_gpt2(GPT2Spec(n_layer=2, d_model=32, n_head=2, seq_len=16, tokenizer="bytes", dropout=0.0))
    assert gpt(torch.randint(0, 256, (3, 16))).shape == (3, 16, 256)
    vgg = build_vgg16(VGG16Spec(width_div=8, classifier_width=64, pool_size=1, image_size=32, dropout=0.0), 10)
    assert vgg(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("workload", ["gpt2", "vgg16"])
def test_metric_sums_stay_on_the_outputs_device(workload: str) -> None:
    """Validation's sums are made where the model's output is (a CPU count stacked with CUDA sums failed
    every framework's first validation on a GPU); the meta device stands in for CUDA here."""
    from repro.recipe import load_file, recipe_path
    from repro.registry import workload_class

    recipe = load_file(recipe_path(workload, "smoke"), [])
    spec = workload_class(workload)(recipe.model, recipe.data, None)
    output = torch.zeros(2, 3, 7, device="meta")
    target = torch.zeros(2, 3, dtype=torch.long, device="meta")
    sums = spec.metric_sums(output, target)
    assert sums.device.type == "meta" and sums.shape == (3,)
