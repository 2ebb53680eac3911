"""Recipes: validation errors name file and field; overrides, fingerprints and flattening."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from repro.recipe import load_file, recipe_path
from repro.schema import RecipeError

pytestmark = pytest.mark.units


def write(tmp_path: Path, change) -> Path:
    raw = yaml.safe_load(recipe_path("gpt2", "smoke").read_text())
    change(raw)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("model,scale", [(m, s) for m in ("gpt2", "vgg16") for s in ("smoke", "paper")])
def test_shipped_recipes_load(model: str, scale: str) -> None:
    recipe = load_file(recipe_path(model, scale))
    assert recipe.workload == model and recipe.scale == scale
    assert len(recipe.fingerprint()) == 64


def test_paper_hyperparameters_match_table_3() -> None:
    vgg, gpt = load_file(recipe_path("vgg16", "paper")), load_file(recipe_path("gpt2", "paper"))
    assert (vgg.train.batch_per_gpu, vgg.train.epochs) == (64, 90)
    assert (vgg.train.optimizer.name, vgg.train.optimizer.lr, vgg.train.optimizer.weight_decay) == ("sgd", 0.01, 1e-4)
    assert (gpt.train.batch_per_gpu, gpt.train.epochs) == (32, 100)
    assert (gpt.train.optimizer.name, gpt.train.optimizer.lr, gpt.train.optimizer.weight_decay) == ("lamb", 0.001, 0.01)


def test_a_frameworks_own_train_settings_apply_to_its_runs_alone_below_the_command_line(tmp_path: Path) -> None:
    """configs/gpt2-paper.yaml's train_by_framework: DDP and ZeRO recompute every block at micro-batches of 8
    (DeepSpeed's GPT-2 345M example) in the device's own 16-bit precision (auto: fp16 on a V100), PipeDream
    and torch-pipeline in fp32; a --set of the same field wins; a framework the kit does not know is named with its file and field."""
    path = recipe_path("gpt2", "paper")
    settings = {fw: (r.train.recompute, r.train.micro_batch, r.train.precision)
                for fw in ("ddp", "zero", "pipedream", "torch-pipeline")
                for r in [load_file(path, [f"run.framework={fw}"])]}
    assert settings == {"ddp": ("full", 8, "auto"), "zero": ("full", 8, "auto"), "pipedream": (None, None, "fp32"),
                        "torch-pipeline": (None, 4, "fp32")}
    ddp = load_file(path, ["run.framework=ddp", "train.micro_batch=4"])
    assert (ddp.train.recompute, ddp.train.micro_batch) == ("full", 4)
    assert "train_by_framework" not in ddp.to_dict()  # folded into train: the fingerprint sees the effective fields
    bad = write(tmp_path, lambda r: r.update(train_by_framework={"horovod": {"micro_batch": 2}}))
    with pytest.raises(RecipeError, match=rf"^{bad}: train_by_framework\.horovod: unknown framework 'horovod'; valid: ddp"):
        load_file(bad)


def test_unknown_key_names_file_field_and_valid_fields(tmp_path: Path) -> None:
    path = write(tmp_path, lambda r: r["train"].update(learning_rate=0.1))
    with pytest.raises(RecipeError) as error:
        load_file(path)
    message = str(error.value)
    assert message.startswith(f"{path}: train.learning_rate: unknown field; valid fields: batch_per_gpu, checkpoint_every, epochs")
    assert "\n" not in message


def test_wrong_type_names_field_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, lambda r: r["train"].update(epochs="three"))
    with pytest.raises(RecipeError, match=r"train\.epochs: expected int, got str 'three'"):
        load_file(path)


def test_bad_choice_lists_valid_ones(tmp_path: Path) -> None:
    path = write(tmp_path, lambda r: r["train"]["optimizer"].update(name="adagrad"))
    with pytest.raises(RecipeError, match=r"train\.optimizer\.name: got 'adagrad'; valid choices: sgd, adam, adamw, lamb"):
        load_file(path)


def test_model_section_is_checked_against_the_workload(tmp_path: Path) -> None:
    path = write(tmp_path, lambda r: r["model"].update(width_div=8))
    with pytest.raises(RecipeError, match=r"model\.width_div: unknown field; valid fields: d_model, dropout"):
        load_file(path)


def test_gpus_must_spread_evenly_over_nodes() -> None:
    with pytest.raises(RecipeError, match=r"gpus \(6\) must spread evenly over nodes \(4\): 6 % 4 = 2"):
        load_file(recipe_path("gpt2", "smoke"), ["run.gpus=6", "run.nodes=4"])


def test_overrides_apply_and_change_the_fingerprint() -> None:
    base = load_file(recipe_path("gpt2", "smoke"))
    changed = load_file(recipe_path("gpt2", "smoke"), ["train.optimizer.lr=0.5", "seed=7"])
    assert changed.train.optimizer.lr == 0.5 and changed.seed == 7
    assert changed.fingerprint() != base.fingerprint()
    assert load_file(recipe_path("gpt2", "smoke")).fingerprint() == base.fingerprint()
    assert changed.flat()["train.optimizer.lr"] == "0.5"


def test_bad_override_syntax() -> None:
    with pytest.raises(RecipeError, match=r"--set: train\.epochs: expected key=value"):
        load_file(recipe_path("gpt2", "smoke"), ["train.epochs"])


def test_round_trip_through_plain_data_keeps_the_fingerprint() -> None:
    from repro.recipe import resolve

    recipe = load_file(recipe_path("vgg16", "smoke"), ["run.gpus=2"])
    again = resolve(recipe.to_dict(), recipe.source)
    assert again.fingerprint() == recipe.fingerprint()
    assert again.run_name() == "vgg16-ddp-2g-smoke-s1234"


def test_fingerprint_ignores_other_frameworks_sections() -> None:
    base = load_file(recipe_path("gpt2", "smoke"))
    assert load_file(recipe_path("gpt2", "smoke"), ["zero.stage=3"]).fingerprint() == base.fingerprint()
    as_zero = load_file(recipe_path("gpt2", "smoke"), ["run.framework=zero"])
    assert load_file(recipe_path("gpt2", "smoke"), ["run.framework=zero", "zero.stage=3"]).fingerprint() != as_zero.fingerprint()


def test_a_micro_batch_must_divide_the_batch_and_recompute_layers_need_recompute() -> None:
    with pytest.raises(RecipeError, match=r"train\.micro_batch: must divide train\.batch_per_gpu into equal "
                                          r"micro-batches: 8 % 3 = 2"):
        load_file(recipe_path("gpt2", "smoke"), ["train.micro_batch=3"])
    with pytest.raises(RecipeError, match=r"train\.recompute_layers: 2 blocks to recompute, but train\.recompute is "
                                          r"unset: set train\.recompute=full"):
        load_file(recipe_path("gpt2", "smoke"), ["train.recompute_layers=2"])
    with pytest.raises(RecipeError, match=r"train\.recompute_layers: vgg16 has 5 blocks to recompute, got 6"):
        load_file(recipe_path("vgg16", "smoke"), ["train.recompute=full", "train.recompute_layers=6"])


@pytest.mark.parametrize("framework,setting,why", [
    ("fsdp", "train.recompute=selective", "fsdp does not apply recompute selective \\(it applies train.recompute=full\\): "
                                          "selective recompute \\(attention's core only\\) is megatron-core's granularity; "
                                          "FSDP2 checkpoints whole blocks"),
    ("zero", "train.recompute=selective", "zero does not apply recompute selective \\(it applies train.recompute=full\\)"),
    ("torch-pipeline", "train.recompute=full", "torch-pipeline does not apply recompute full: recompute around its "
                                               "stages' blocks is not yet applied by the kit"),
    ("pipedream", "train.micro_batch=4", "pipedream does not accumulate gradients over micro-batches: PipeDream has no such"),
    ("torchgpipe", "train.recompute=none", "torchgpipe does not take train.recompute: torchgpipe recomputes and cuts "
                                           "micro-batches its own way: set torchgpipe.checkpoint"),
    ("ddp", "train.recompute=selective", "ddp does not apply recompute selective \\(it applies train.recompute=full\\): "
                                         "selective recompute"),
])
def test_a_memory_setting_a_framework_does_not_apply_is_refused_saying_why(framework, setting, why) -> None:
    with pytest.raises(RecipeError, match=why):
        load_file(recipe_path("gpt2", "smoke"), [f"run.framework={framework}", "run.gpus=2", setting])


def test_megatrons_selective_recompute_takes_no_number_of_layers_and_full_is_the_block_method() -> None:
    from repro.adapters.megatron_plan import MegatronPlan

    with pytest.raises(RecipeError, match=r"train\.recompute_layers: megatron-core's selective recompute takes no number"):
        load_file(recipe_path("gpt2", "smoke"), ["run.framework=megatron", "train.recompute=selective", "train.recompute_layers=2"])
    full = load_file(recipe_path("gpt2", "smoke"), ["run.framework=megatron", "train.recompute=full", "train.recompute_layers=2"])
    assert MegatronPlan.recompute_config(full) == {"recompute_granularity": "full", "recompute_method": "block",
                                                   "recompute_num_layers": 2}
    every = load_file(recipe_path("gpt2", "smoke"), ["run.framework=megatron", "train.recompute=full"])
    assert MegatronPlan.recompute_config(every)["recompute_num_layers"] == 4  # GPT-2 smoke's layers, all


def test_the_memory_settings_are_recorded_as_effective_and_default_to_the_frameworks_own() -> None:
    from repro import registry

    def effective(framework: str, *sets: str) -> tuple:
        recipe = load_file(recipe_path("gpt2", "smoke"), [f"run.framework={framework}", *sets])
        values = registry.plan_class(framework).effective(recipe)
        return values["micro_batches"], values["recompute"]

    assert effective("ddp") == (1, "none") and effective("torchgpipe") == (4, "except_last")
    assert effective("ddp", "train.micro_batch=2", "train.recompute=full") == (4, "full")
    assert effective("ddp", "train.micro_batch=8") == (1, "none")  # one micro-batch of the whole batch: no accumulation
    assert effective("torchgpipe", "torchgpipe.checkpoint=always") == (4, "always")
    assert effective("fsdp", "train.micro_batch=2", "train.recompute=full") == (4, "full")
    assert effective("megatron", "train.micro_batch=2", "train.recompute=selective") == (4, "selective")
