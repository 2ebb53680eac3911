"""LBANN without its binary: the recipe's translation, the launch commands, the log parser, the events.

LBANN itself (the C++ binary and its Python front end) is not installed here; docs/containers.md
gives the command that runs it in the image on GPUs.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from repro import events, launch, names, tracking
from repro.adapters import lbann as translation
from repro.adapters.lbann_driver import MEMORY_METHOD, Job, epoch_events
from repro.adapters.lbann_log import GIB, parse, trainer_epochs
from repro.recipe import load_file, recipe_path
from repro.runfiles import EVENTS_FILE
from repro.schema import RecipeError
from repro.workloads.vgg16 import VGG16Spec, build_vgg16

pytestmark = pytest.mark.units

GOLDEN = Path(__file__).parent / "golden"
PAPER_FP32 = ["run.framework=lbann", "train.precision=fp32"]


def lbann_recipe(scale: str, *overrides: str):
    return load_file(recipe_path("vgg16", scale), ["run.framework=lbann", *overrides])


# -- availability and applicability --------------------------------------------------------------


def test_absent_lbann_fails_at_once_saying_how_to_get_it(repro) -> None:
    result = repro.here("run", "vgg16", "--framework", "lbann", "--gpus", "2")
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "framework 'lbann' is not available here: missing lbann;" in line
    assert "container image" in line and "spack install lbann@0.104 +cuda +vision +pfe" in line
    assert not (repro.cwd / "runs").exists()
    listing = repro.here("list")
    assert any(l.split()[0] == "lbann" and "unavailable" in l for l in listing.stdout.splitlines())


def test_gpt2_is_not_applicable() -> None:
    with pytest.raises(RecipeError, match="lbann is not applicable to gpt2: the kit translates only VGG-16"):
        load_file(recipe_path("gpt2", "smoke"), ["run.framework=lbann"])


@pytest.mark.parametrize("overrides, field, message", [
    (["train.precision=bf16"], "train.precision", "fp32 only, got bf16"),  # the recipe's lbann entry says fp32
    (["train.precision=fp32", "train.max_steps=5"], "train.max_steps", "whole epochs"),
    (["train.precision=fp32", "model.image_size=256"], "model.pool_size",
     "image_size 256 / 2**5 = 8 != pool_size 7"),
    (["train.precision=fp32", "train.optimizer.name=lamb"], "train.optimizer.name", "sgd, adam here, not lamb"),
])
def test_recipes_lbann_cannot_run_fail_naming_the_field(overrides: list[str], field: str, message: str) -> None:
    with pytest.raises(RecipeError, match=re.escape(message)) as error:
        lbann_recipe("paper", *overrides)
    assert error.value.field == field


# -- the translation -------------------------------------------------------------------------------


def torch_layers(model: nn.Sequential) -> list[nn.Module]:
    """The layers LBANN mirrors (the adaptive pool is an identity there, the flatten implicit)."""
    return [m for m in model if not isinstance(m, (nn.AdaptiveAvgPool2d, nn.Flatten))]


@pytest.mark.parametrize("spec, classes", [(VGG16Spec(), 1000), (VGG16Spec(8, 128, 1, 32, 0.0), 10)],
                         ids=["paper", "smoke"])
def test_layers_match_the_workload_model(spec: VGG16Spec, classes: int) -> None:
    with torch.device("meta"):
        model = build_vgg16(spec, classes)
    planned = translation.layers(spec, classes)
    assert len(planned) == len(torch_layers(model))
    for layer, module in zip(planned, torch_layers(model)):
        if isinstance(module, nn.Conv2d):
            assert layer["kind"] == "convolution"
            assert (layer["out_channels"], layer["kernel_size"], layer["stride"], layer["padding"]) == (
                module.out_channels, module.kernel_size[0], module.stride[0], module.padding[0])
            fan_out = nn.init._calculate_correct_fan(module.weight, "fan_out")
            assert layer["init_std"] == pytest.approx(nn.init.calculate_gain("relu") / math.sqrt(fan_out))
        elif isinstance(module, nn.Linear):
            assert (layer["kind"], layer["size"], layer["init_std"]) == ("fully_connected", module.out_features, 0.01)
        elif isinstance(module, nn.MaxPool2d):
            assert (layer["kind"], layer["size"], layer["stride"]) == ("max_pool", module.kernel_size, module.stride)
        elif isinstance(module, nn.Dropout):
            assert (layer["kind"], layer["keep_prob"]) == ("dropout", 1 - module.p)
        else:
            assert isinstance(module, nn.ReLU) and layer["kind"] == "relu"
    parameters = sum(p.numel() for p in model.parameters())
    assert translation.parameter_count(planned, 3, spec.image_size) == parameters
    if classes == 1000:
        assert parameters == 138_357_544  # torchvision's vgg16


def test_plan_carries_the_paper_recipe() -> None:
    recipe = lbann_recipe("paper", "train.precision=fp32", "run.gpus=8", "run.nodes=2")
    plan = translation.plan(recipe, Path("/data/imagenet"), Path("/runs/r/lbann"), 1000)
    assert plan["mini_batch_size"] == 64 * 8  # the paper's rule: per-GPU batch times GPUs
    assert (plan["epochs"], plan["seed"]) == (90, 1234)
    assert plan["optimizer"] == {"name": "sgd", "learn_rate": 0.01, "momentum": 0.9}
    assert plan["l2_scale"] == 0.0001
    train, val = plan["readers"]
    assert (train["role"], train["shuffle"], train["data_filedir"], train["num_labels"]) == (
        "train", True, "/data/imagenet/train/", 1000)
    assert (val["role"], val["shuffle"], val["data_filename"]) == ("validate", False, "/runs/r/lbann/val.txt")
    # LBANN's own ImageNet reader (applications/vision/data/imagenet/data_reader.prototext): colorize
    # turns ILSVRC2012's grayscale JPEGs into 3 channels before the 3-channel normalisation.
    assert train["transforms"] == [
        {"random_resized_crop": {"height": 224, "width": 224}}, {"horizontal_flip": {"p": 0.5}}, {"colorize": {}},
        {"normalize_to_lbann_layout": {"means": "0.406 0.456 0.485", "stddevs": "0.225 0.224 0.229"}},
    ]
    assert val["transforms"][:2] == [
        {"resized_center_crop": {"height": 256, "width": 256, "crop_height": 224, "crop_width": 224}}, {"colorize": {}}]
    assert (plan["callbacks"], plan["grad_clip"]) == (["print", "timer", "gpu_memory_usage"], None)
    state = translation.model_state_bytes(plan)
    assert state == {"parameters": 138_357_544 * 4, "gradients": 138_357_544 * 4, "optimizer": 138_357_544 * 4}


def test_plan_carries_the_smoke_recipe() -> None:
    recipe = lbann_recipe("smoke", "run.gpus=2")
    plan = translation.plan(recipe, Path("/d"), Path("/w"), 10)
    assert plan["mini_batch_size"] == 32
    assert plan["optimizer"] == {"name": "adam", "learn_rate": 0.0005, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    assert plan["l2_scale"] == 0.0
    # LBANN's reader takes the sample size only from a crop or resize (else 256x256): digits get a resize.
    assert plan["readers"][0]["transforms"] == [
        {"resize": {"height": 32, "width": 32}}, {"colorize": {}},
        {"normalize_to_lbann_layout": {"means": "0.5 0.5 0.5", "stddevs": "0.5 0.5 0.5"}}]
    assert translation.model_state_bytes(plan)["optimizer"] == 2 * translation.model_state_bytes(plan)["parameters"]


def test_gradient_clipping_goes_to_lbanns_callback() -> None:
    plan = translation.plan(lbann_recipe("smoke", "train.grad_clip=0.5"), Path("/d"), Path("/w"), 10)
    assert plan["grad_clip"] == 0.5  # lbann_experiment.py: CallbackClipGradientNorm(global_norm=True, value=0.5)


def digits_root() -> Path:
    from repro.data import DataError
    from repro.data.sets import dataset

    try:
        return dataset("digits").locate()
    except DataError as error:
        pytest.skip(f"needs the digits set: {error}")


def test_label_lists_are_the_samples_the_other_frameworks_read(tmp_path: Path) -> None:
    from repro.workloads.vgg16 import VGG16Workload

    root = digits_root()
    recipe = lbann_recipe("smoke", "data.max_train_samples=100")
    train, val = VGG16Workload(recipe.model, recipe.data, root).datasets()
    Job.write_label_list(train, root / "train", tmp_path / "train.txt")
    Job.write_label_list(val, root / "val", tmp_path / "val.txt")
    lines = (tmp_path / "train.txt").read_text().splitlines()
    assert len(lines) == 100 and len((tmp_path / "val.txt").read_text().splitlines()) == len(val)
    # LBANN's image reader refuses a label outside [0, num_labels) (src/data_readers/data_reader_image.cpp).
    assert {int(line.split()[1]) for line in lines} <= set(range(10))
    for index in (0, 57, 99):
        relative, label = lines[index].split()
        image, target = train[index]
        assert int(label) == target == train.dataset.samples[index][1]
        assert (root / "train" / relative).is_file() and relative.startswith(f"{target}/")


# -- the launch ------------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher, nodes, gpus", [("slurm", 2, 8), ("mpirun", 1, 4)])
def test_launch_command_matches_the_recorded_one(launcher: str, nodes: int, gpus: int) -> None:
    prototext = Path("RUN_DIR/lbann/experiment.prototext")
    command = launch.LBANN_LAUNCHERS[launcher](nodes, gpus, "/opt/lbann/view/bin/lbann", prototext)
    golden = "lbann-srun.txt" if launcher == "slurm" else "lbann-mpirun.txt"
    assert command == (GOLDEN / golden).read_text().splitlines()


def test_auto_launcher_follows_the_allocation() -> None:
    assert launch.lbann_launcher("auto", {"SLURM_JOB_ID": "42"}) == "slurm"
    assert launch.lbann_launcher("auto", {}) == "mpirun"
    assert launch.lbann_launcher("mpirun", {"SLURM_JOB_ID": "42"}) == "mpirun"


def test_runner_launches_the_lbann_driver() -> None:
    recipe = lbann_recipe("smoke")
    command = translation.LBANNPlan.command(recipe, Path("/runs/x"))
    assert command[1:] == ["-m", "repro.adapters.lbann_driver", "/runs/x"]


# -- the output ------------------------------------------------------------------------------------
# Fixtures: only lines LBANN 0.104 prints, each with the file that prints it (src/callbacks/ at tag
# v0.104), in the order its callbacks run (print, timer, gpu_memory_usage, as the plan lists them):
# epoch begin (header, then one memory line per trainer), training epoch end (objective, metrics,
# run time, mini-batch statistics), validation end (the same). Trainer 1's lines interleave with
# trainer 0's, as two processes' output does, each in its own order.
PRINT, TIMER, MEMORY = ("src/callbacks/print_statistics.cpp", "src/callbacks/timer.cpp",
                        "src/callbacks/gpu_memory_usage.cpp")
DASHES = "-" * 92  # print_statistics.cpp: two literals of 61 and 31 dashes

TWO_TRAINERS = [
    (PRINT, DASHES),
    (PRINT, "[0] Epoch : stats formated [tr/v/te/to] iter/epoch = [45/12/0/0]"),
    (PRINT, "            Global MB = [  32/  32/   0/   0]  Global last MB = [  25/  12/   0/   0]"),
    (PRINT, DASHES),
    (MEMORY, "Model 0 GPU memory usage statistics : 0.902 GiB mean, 0.902 GiB median, 0.902 GiB max, 0.902 GiB min "
             "(79.2 GiB total)"),
    (MEMORY, "Model 1 GPU memory usage statistics : 0.871 GiB mean, 0.871 GiB median, 0.871 GiB max, 0.871 GiB min "
             "(79.2 GiB total)"),
    (PRINT, "model0 (instance 0) training epoch 0 objective function : 2.30281"),
    (PRINT, "model0 (instance 0) training epoch 0 accuracy : 11.5385%"),
    (PRINT, "model0 (instance 1) training epoch 0 objective function : 2.30299"),
    (PRINT, "model0 (instance 0) training epoch 0 cross_entropy : 2.30281"),
    (TIMER, "model0 (instance 0) training epoch 0 run time : 4.21437s"),
    (PRINT, "model0 (instance 1) training epoch 0 accuracy : 10.2941%"),
    (TIMER, "model0 (instance 0) training epoch 0 mini-batch time statistics : 0.0957s mean, 0.0931s median, "
            "0.161s max, 0.0902s min, 0.0113s stdev"),
    (PRINT, "model0 (instance 1) training epoch 0 cross_entropy : 2.30299"),
    (TIMER, "model0 (instance 1) training epoch 0 run time : 4.3s"),
    (TIMER, "model0 (instance 1) training epoch 0 mini-batch time statistics : 0.0977s mean, 0.0951s median, "
            "0.171s max, 0.0912s min, 0.0123s stdev"),
    (PRINT, "model0 (instance 0) validation objective function : 2.30155"),
    (PRINT, "model0 (instance 0) validation accuracy : 18.3333%"),
    (PRINT, "model0 (instance 0) validation cross_entropy : 2.30155"),
    (TIMER, "model0 (instance 0) validation run time : 0.705s"),
    (TIMER, "model0 (instance 0) validation mini-batch time statistics : 0.0587s mean, 0.0571s median, "
            "0.0702s max, 0.0564s min, 0.00391s stdev"),
    (PRINT, "model0 (instance 1) validation objective function : 2.30212"),
    (PRINT, "model0 (instance 1) validation accuracy : 10%"),
    (PRINT, "model0 (instance 1) validation cross_entropy : 2.30212"),
    (PRINT, DASHES),
    (PRINT, "[1] Epoch : stats formated [tr/v/te/to] iter/epoch = [45/12/0/0]"),
    (PRINT, "            Global MB = [  32/  32/   0/   0]  Global last MB = [  25/  12/   0/   0]"),
    (PRINT, DASHES),
    (MEMORY, "Model 0 GPU memory usage statistics : 1.25 GiB mean, 1.25 GiB median, 1.25 GiB max, 1.25 GiB min "
             "(79.2 GiB total)"),
    (PRINT, "model0 (instance 0) training epoch 1 objective function : 1.52214"),
    (PRINT, "model0 (instance 0) training epoch 1 accuracy : 45.2941%"),
    (PRINT, "model0 (instance 0) training epoch 1 cross_entropy : 1.52214"),
    (TIMER, "model0 (instance 0) training epoch 1 run time : 3.98112s"),
    (TIMER, "model0 (instance 0) training epoch 1 mini-batch time statistics : 0.0905s mean, 0.0899s median, "
            "0.112s max, 0.0887s min, 0.00412s stdev"),
    (PRINT, "model0 (instance 0) validation objective function : 0.841637"),
    (PRINT, "model0 (instance 0) validation accuracy : 71.4286%"),
    (PRINT, "model0 (instance 0) validation cross_entropy : 0.841637"),
    (TIMER, "model0 (instance 0) validation run time : 0.698s"),
    (TIMER, "model0 (instance 0) validation mini-batch time statistics : 0.0581s mean, 0.0569s median, "
            "0.0695s max, 0.0561s min, 0.00382s stdev"),
    (PRINT, DASHES),
    (PRINT, "[2] Epoch : stats formated [tr/v/te/to] iter/epoch = [45/12/0/0]"),
    (PRINT, "            Global MB = [  32/  32/   0/   0]  Global last MB = [  25/  12/   0/   0]"),
    (PRINT, DASHES),
    (MEMORY, "Model 0 GPU memory usage statistics : 1.5 GiB mean, 1.5 GiB median, 1.5 GiB max, 1.5 GiB min "
             "(79.2 GiB total)"),
    (PRINT, "model0 (instance 0) training epoch 2 objective function : 0.00160377"),
    (PRINT, "model0 (instance 0) training epoch 2 accuracy : 99.9717%"),
    (PRINT, "model0 (instance 0) training epoch 2 cross_entropy : 0.00160377"),
    (TIMER, "model0 (instance 0) training epoch 2 run time : 0.80641s"),
    (TIMER, "model0 (instance 0) training epoch 2 mini-batch time statistics : 0.0179s mean, 0.0178s median, "
            "0.0241s max, 0.0171s min, 0.00102s stdev"),
    (PRINT, "model0 (instance 0) validation objective function : 34.3421"),
    (PRINT, "model0 (instance 0) validation accuracy : 55.5%"),
    (PRINT, "model0 (instance 0) validation cross_entropy : 34.3421"),
    (TIMER, "model0 (instance 0) validation run time : 0.701s"),
    (TIMER, "model0 (instance 0) validation mini-batch time statistics : 0.0584s mean, 0.057s median, "
            "0.0698s max, 0.0562s min, 0.00385s stdev"),
]

# One epoch that diverged: the streams print nan, -nan and inf. 68 training samples in mini-batches of 32
# (3 steps, the last of 4), 24 validation samples (one mini-batch, so no standard deviation: N/A).
DIVERGED = [
    (PRINT, DASHES),
    (PRINT, "[0] Epoch : stats formated [tr/v/te/to] iter/epoch = [3/1/0/0]"),
    (PRINT, "            Global MB = [  32/  32/   0/   0]  Global last MB = [   4/  24/   0/   0]"),
    (PRINT, DASHES),
    (MEMORY, "Model 0 GPU memory usage statistics : 0.688 GiB mean, 0.688 GiB median, 0.688 GiB max, 0.688 GiB min "
             "(79.2 GiB total)"),
    (PRINT, "model0 (instance 0) training epoch 0 objective function : nan"),
    (PRINT, "model0 (instance 0) training epoch 0 accuracy : 9.375%"),
    (PRINT, "model0 (instance 0) training epoch 0 cross_entropy : -nan"),
    (TIMER, "model0 (instance 0) training epoch 0 run time : 0.31s"),
    (TIMER, "model0 (instance 0) training epoch 0 mini-batch time statistics : 0.0998s mean, 0.0941s median, "
            "0.121s max, 0.0842s min, 0.0191s stdev"),
    (PRINT, "model0 (instance 0) validation objective function : inf"),
    (PRINT, "model0 (instance 0) validation accuracy : 8.33333%"),
    (PRINT, "model0 (instance 0) validation cross_entropy : inf"),
    (TIMER, "model0 (instance 0) validation run time : 0.0621s"),
    (TIMER, "model0 (instance 0) validation mini-batch time statistics : 0.0603s mean, 0.0603s median, "
            "0.0603s max, 0.0603s min, N/A stdev"),
]


def log(lines: list[tuple[str, str]]) -> str:
    return "".join(f"{line}\n" for _, line in lines)


LOG = log(TWO_TRAINERS)


def test_fixture_lines_have_the_shapes_of_lbanns_source() -> None:
    """Each line is one of the formats its file prints (the C++ stream statements, as patterns)."""
    number = r"-?(nan|inf|[0-9.]+(e[-+][0-9]+)?)"
    shapes = {
        PRINT: [rf"-{{92}}", r"\[\d+\] Epoch : stats formated \[tr/v/te/to\] iter/epoch = \[\d+/\d+/\d+/\d+\]",
                r" {12}Global MB = \[( {0,3}\d+/){3} {0,3}\d+\]  Global last MB = \[( {0,3}\d+/){3} {0,3}\d+\]",
                rf"model0 \(instance \d\) (training epoch \d+|validation) (objective function|accuracy|cross_entropy)"
                rf" : {number}%?"],
        TIMER: [rf"model0 \(instance \d\) (training epoch \d+|validation) run time : {number}s",
                rf"model0 \(instance \d\) (training epoch \d+|validation) mini-batch time statistics : "
                rf"({number}s|N/A) mean, {number}s median, ({number}s|N/A) max, ({number}s|N/A) min, "
                rf"({number}s|N/A) stdev"],
        MEMORY: [rf"Model \d GPU memory usage statistics : {number} GiB mean, {number} GiB median, {number} GiB max, "
                 rf"{number} GiB min \({number} GiB total\)"],
    }
    for source, line in TWO_TRAINERS + DIVERGED:
        assert any(re.fullmatch(shape, line) for shape in shapes[source]), (source, line)


def test_parser_reads_every_trainer_and_epoch() -> None:
    epochs = parse(LOG)
    assert sorted((e.trainer, e.epoch) for e in epochs) == [(0, 0), (0, 1), (0, 2), (1, 0)]
    first, second, third = trainer_epochs(epochs, 0)
    assert first.training == {"objective function": 2.30281, "accuracy": 11.5385, "cross_entropy": 2.30281,
                              "run time": 4.21437}
    assert first.validation == {"objective function": 2.30155, "accuracy": 18.3333, "cross_entropy": 2.30155,
                                "run time": 0.705}
    assert second.validation["accuracy"] == 71.4286
    assert third.training["objective function"] == 0.00160377 and third.validation["accuracy"] == 55.5
    [other] = trainer_epochs(epochs, 1)
    assert other.training == {"objective function": 2.30299, "accuracy": 10.2941, "cross_entropy": 2.30299,
                              "run time": 4.3}
    assert other.validation == {"objective function": 2.30212, "accuracy": 10.0, "cross_entropy": 2.30212}


def test_memory_belongs_to_the_epoch_it_precedes() -> None:
    """gpu_memory_usage.cpp reads the memory in on_epoch_begin: each reading is the next epoch's,
    the first one included, and the last epoch has its own ("Model N" is trainer N)."""
    first, second, third = trainer_epochs(parse(LOG), 0)
    assert first.memory_gib == {"mean": 0.902, "median": 0.902, "max": 0.902, "min": 0.902, "total": 79.2}
    assert (second.memory_gib["max"], third.memory_gib["max"]) == (1.25, 1.5)
    [other] = trainer_epochs(parse(LOG), 1)
    assert other.memory_gib["max"] == 0.871
    [only] = parse(log(DIVERGED))
    assert only.memory_gib["max"] == 0.688


def test_parser_keeps_a_diverged_epoch() -> None:
    [epoch] = parse(log(DIVERGED))
    assert math.isnan(epoch.training["objective function"]) and math.isnan(epoch.training["cross_entropy"])
    assert epoch.training["accuracy"] == 9.375 and epoch.training["run time"] == 0.31
    assert epoch.validation["objective function"] == math.inf == epoch.validation["cross_entropy"]
    state = {"parameters": 400, "gradients": 400, "optimizer": 800}
    step, record = epoch_events(epoch, 0.0, steps_per_epoch=3, samples=68, state_bytes=state)
    assert math.isnan(step["loss"]) and record["val"]["val/loss"] == math.inf
    assert record["val"]["val/accuracy"] == pytest.approx(0.0833333)


def test_parser_on_a_partial_log_keeps_what_it_has() -> None:
    cut = next(i for i, (_, line) in enumerate(TWO_TRAINERS) if "training epoch 1 run time" in line)
    first, second = trainer_epochs(parse(log(TWO_TRAINERS[:cut])), 0)
    assert first.validation["accuracy"] == 18.3333
    assert second.training == {"objective function": 1.52214, "accuracy": 45.2941, "cross_entropy": 1.52214}
    assert second.memory_gib["max"] == 1.25
    assert parse("") == []
    assert parse("model0 (instance 0) test accuracy : 5%\nmodel0 (global average) training epoch 0 accuracy : 5%\n") == []


def test_epochs_become_the_loops_events_and_mlflow_metrics() -> None:
    first, second, _ = trainer_epochs(parse(LOG), 0)
    state = {"parameters": 400, "gradients": 400, "optimizer": 800}
    step, epoch = epoch_events(first, 0.0, steps_per_epoch=45, samples=1433, state_bytes=state)
    assert step == {"event": events.STEP, "step": 45, "epoch": 0, "loss": 2.30281}
    assert epoch["val"] == {"val/loss": 2.30155, "val/accuracy": pytest.approx(0.183333)}
    assert epoch["train"] == {"train/objective": 2.30281, "train/accuracy": pytest.approx(0.115385)}
    assert (epoch["epoch_s"], epoch["elapsed_s"]) == (4.21437, 4.21437)
    assert epoch["samples_per_s"] == pytest.approx(1433 / 4.21437)
    assert epoch["ranks"] == [{"rank": 0, "method": MEMORY_METHOD, "peak_bytes": round(0.902 * GIB), **state}]
    metrics = {key: value for key, value, _ in tracking.event_metrics(epoch)}
    assert metrics["val/accuracy"] == pytest.approx(0.183333)
    assert metrics["train/accuracy"] == pytest.approx(0.115385)
    assert metrics[names.PEAK_MEMORY] == round(0.902 * GIB)
    assert metrics[names.MODEL_STATE] == 1600
    _, epoch = epoch_events(second, 4.21437, steps_per_epoch=45, samples=1433, state_bytes=state)
    assert epoch["elapsed_s"] == pytest.approx(4.21437 + 3.98112)
    assert epoch["ranks"][0]["peak_bytes"] == round(1.25 * GIB)
    # A build without GPUs prints no memory line: the peak is unknown, not zero.
    second.memory_gib = {}
    _, epoch = epoch_events(second, 4.21437, steps_per_epoch=45, samples=1433, state_bytes=state)
    assert math.isnan(epoch["ranks"][0]["peak_bytes"])


def test_driver_writes_lbanns_inputs_and_follows_its_log(tmp_path: Path, monkeypatch) -> None:
    import subprocess

    root = digits_root()
    recipe = lbann_recipe("smoke", "run.gpus=4", "run.nodes=2", "train.epochs=3")
    job = Job(recipe, tmp_path, root)
    plan = (tmp_path / "lbann" / "plan.json").read_text()
    assert '"mini_batch_size": 64' in plan and f'"data_filedir": "{root}/train/"' in plan
    train_lines = (tmp_path / "lbann" / "train.txt").read_text().splitlines()
    assert len(train_lines) == job.train_samples == 1433  # digits: 1797 images, every 5th of a class for validation
    assert job.steps_per_epoch == 23  # 1433 / 64 = 22.4: the last mini-batch is partial
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    prototext = tmp_path / "lbann" / "experiment.prototext"
    assert job.command(prototext)[:4] == ["srun", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2"]
    # The log of a finished job becomes trainer 0's three epochs, as the loop would have written them.
    (tmp_path / "lbann" / "out.log").write_text(LOG)
    assert job.follow(subprocess.Popen(["true"]), tmp_path / "lbann" / "out.log") == 0
    job.writer.close()
    written = events.read_all(tmp_path / EVENTS_FILE)
    assert [e["event"] for e in written] == [events.STEP, events.EPOCH] * 3 + [events.END]
    epochs = [e for e in written if e["event"] == events.EPOCH]
    assert [(e["epoch"], e["step"]) for e in epochs] == [(0, 23), (1, 46), (2, 69)]
    assert epochs[2]["val"] == {"val/loss": 34.3421, "val/accuracy": 0.555}
    assert written[-1]["step"] == 69
    for epoch in epochs:
        assert {key for key, _, _ in tracking.event_metrics(epoch)} >= {"val/loss", "train/objective", names.EPOCH_TIME}
