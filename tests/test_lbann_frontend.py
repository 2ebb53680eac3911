"""The kit's LBANN experiments built by LBANN 0.104's own front end and read back with its own schema.

LBANN's Python front end and .proto files are vendored read-only in ../shared/vendor/lbann-0.104
(never copied into the kit). The fixture makes them what a Spack build of `lbann@0.104 +pfe`
installs: the schema compiled with protoc 3.21 into *_pb2.py, the front end importable by an
isolated Python (`python -I`, as the driver runs it) with protobuf 4.21 and numpy (.venv-lbann,
`make lbann-python`). The driver's own export then runs on the plans of both VGG-16 recipes; the
front end raises on any unknown layer argument, and the test parses the prototext back into
lbann_pb2.LbannPB with the kit's protobuf (a second, independent reading of the schema) and
compares what it holds with what the recipe says.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from repro.adapters import lbann as translation
from repro.adapters.lbann_driver import export_prototext
from repro.recipe import load_file, recipe_path

pytestmark = pytest.mark.units

REPO = Path(__file__).resolve().parent.parent
VENDOR = Path(os.environ.get("REPRO_LBANN_VENDOR", REPO.parent / "shared" / "vendor" / "lbann-0.104"))
LBANN_PYTHON = REPO / ".venv-lbann" / "bin" / "python"


def compile_schema(python: Path, out: Path) -> Path:
    """LBANN's .proto files compiled by `python`'s grpc_tools.protoc into `out`."""
    out.mkdir()
    protos = sorted(str(p) for p in (VENDOR / "src" / "proto").glob("*.proto"))
    subprocess.run([str(python), "-m", "grpc_tools.protoc", f"-I{VENDOR / 'src' / 'proto'}", f"--python_out={out}",
                    *protos], check=True)
    return out


@pytest.fixture(scope="session")
def frontend(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment under which the driver's `python -I lbann_experiment.py` finds LBANN's front end."""
    for needed, how in ((VENDOR, "set REPRO_LBANN_VENDOR to the vendored lbann-0.104 folder"),
                        (LBANN_PYTHON, "run `make lbann-python`")):
        if not needed.exists():
            pytest.fail(f"{needed} is missing: {how}")
    root = tmp_path_factory.mktemp("lbann")
    schema = compile_schema(LBANN_PYTHON, root / "proto")
    site = root / "site"
    shutil.copytree(VENDOR / "python" / "lbann", site / "lbann")
    # What LBANN's CMake build writes (cmake/modules/LBANNWritePythonFeatures.cmake), with no features.
    (site / "lbann" / "lbann_features.py").write_text(
        "lbann_features = set()\n\n\ndef has_feature(name):\n    return name.upper() in lbann_features\n\n\n"
        "def get_features():\n    return lbann_features\n"
    )
    # lbann/__init__.py reads both keys; without lbann_exe it silently drops the schema.
    config = root / "python_config.ini"
    config.write_text(f"[Paths]\nlbann_pb2.py={schema / 'lbann_pb2.py'}\nlbann_exe=lbann\n")
    # LBANN's Python: a venv over .venv-lbann whose site-packages holds the front end, as Spack's view does.
    python = root / "python"
    subprocess.run([str(LBANN_PYTHON), "-m", "venv", "--without-pip", str(python)], check=True)
    base_site = subprocess.run([str(LBANN_PYTHON), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip()
    own_site = subprocess.run([str(python / "bin" / "python"), "-c",
                               "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True).stdout.strip()
    Path(own_site, "lbann-frontend.pth").write_text(f"{base_site}\n{site}\n")
    return {"LBANN_PYTHON": str(python / "bin" / "python"), "LBANN_PYTHON_CONFIG_FILE": str(config)}


def recipe_plan(recipe, classes: int) -> dict:
    return translation.plan(recipe, Path("/data/set"), Path("/runs/r/lbann"), classes)


def export(plan: dict, tmp_path: Path, frontend: dict[str, str], monkeypatch) -> Path:
    """The driver's own export of `plan`, under LBANN's Python; the prototext's path."""
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    for key, value in frontend.items():
        monkeypatch.setenv(key, value)
    export_prototext(tmp_path / "plan.json", tmp_path / "experiment.prototext")
    return tmp_path / "experiment.prototext"


# -- the experiment read back: lines that say what it holds, independent of the front end's order -----


def initializer_line(weights) -> str:
    kind = weights.initializer.WhichOneof("initializer_type")
    if kind == "normal_initializer":
        normal = weights.initializer.normal_initializer
        return f"normal(mean={normal.mean:.6g}, std={normal.standard_deviation:.6g})"
    assert kind == "constant_initializer", kind
    return f"constant({weights.initializer.constant_initializer.value:.6g})"


def layer_line(layer, initializers: dict[str, str]) -> str:
    kind = layer.WhichOneof("layer_type")
    params = getattr(layer, kind)
    if kind == "convolution":
        line = (f"convolution out_channels={params.out_channels} kernel_size={list(params.kernel_size)} "
                f"stride={list(params.stride)} padding={list(params.padding)} bias={params.has_bias.value}")
    elif kind == "fully_connected":
        line = f"fully_connected num_neurons={params.num_neurons} bias={params.has_bias}"
    elif kind == "pooling":
        line = f"pooling {params.pool_mode} dims={params.pool_dims_i} strides={params.pool_strides_i}"
    elif kind == "dropout":
        line = f"dropout keep_prob={params.keep_prob:.6g}"
    elif kind == "input":
        line = f"input {params.data_field}"
    else:
        line = kind
    return " ".join([line, *(initializers[name] for name in layer.weights)])


def model_lines(model) -> list[str]:
    """Layers along the graph from the image input (position, kind, arguments, initializers of their
    weights), then the layers that read the softmax, the objective, the metrics and the callbacks."""
    initializers = {w.name: initializer_line(w) for w in model.weights}
    layers = {layer.name: layer for layer in model.layer}
    [name] = [layer.name for layer in model.layer if layer.WhichOneof("layer_type") == "input"
              and layer.input.data_field == "samples"]
    lines = []
    while len(layers[name].children) == 1:
        lines.append(f"{len(lines):02d} {layer_line(layers[name], initializers)}")
        name = layers[name].children[0]
    lines.append(f"{len(lines):02d} {layer_line(layers[name], initializers)}")
    kinds = {layer.name: layer.WhichOneof("layer_type") for layer in model.layer}
    for child in layers[name].children:
        lines.append(f"head {kinds[child]}({', '.join(kinds[p] for p in layers[child].parents)})")
    objective = model.objective_function
    lines += [f"objective {kinds[term.layer]} x{term.scale_factor:.6g}" for term in objective.layer_term]
    lines += [f"objective l2 x{term.scale_factor:.6g} weights={list(term.weights)}"
              for term in objective.l2_weight_regularization]
    lines += [f"metric {m.layer_metric.name} {kinds[m.layer_metric.layer]} unit={m.layer_metric.unit!r}"
              for m in model.metric]
    for callback in model.callback:
        kind = callback.WhichOneof("callback_type")
        clip = callback.clip_gradient_norm
        lines.append(f"callback {kind}" + (f" global_norm={clip.global_norm} value={clip.value:.6g}"
                                           if kind == "clip_gradient_norm" else ""))
    return lines + [f"epochs {model.num_epochs}"]


def run_lines(experiment) -> list[str]:
    """Trainer, optimizer and readers (transforms in their order) as lines."""
    trainer, optimizer = experiment.trainer, experiment.optimizer
    kind = optimizer.WhichOneof("optimizer_type")
    fields = {f.name: v for f, v in getattr(optimizer, kind).ListFields()}
    lines = [f"trainer mini_batch_size={trainer.mini_batch_size} random_seed={trainer.random_seed}",
             f"optimizer {kind} {fields}"]
    for reader in experiment.data_reader.reader:
        lines.append(f"reader {reader.role} {reader.name} shuffle={reader.shuffle} dir={reader.data_filedir} "
                     f"list={reader.data_filename} labels={reader.num_labels} "
                     f"fraction={reader.fraction_of_data_to_use:.6g}")
        for index, transform in enumerate(reader.transforms):
            kind = transform.WhichOneof("transform_type")
            fields = {f.name: v for f, v in getattr(transform, kind).ListFields()}
            lines.append(f"reader {reader.role} transform {index} {kind} {fields}")
    return lines


def sample_dims(reader) -> tuple[int, int, int]:
    """(channels, height, width) of the reader's samples, by the rules of LBANN 0.104's
    src/proto/init_image_data_readers.cpp: the size of the last crop or resize transform, else the
    imagenet reader's 256x256 (src/data_readers/data_reader_imagenet.cpp); 3 channels unless grayscale."""
    height = width = 256
    channels = 3
    for transform in reader.transforms:
        kind = transform.WhichOneof("transform_type")
        params = getattr(transform, kind)
        if kind in ("center_crop", "random_crop", "random_resized_crop", "resize"):
            height, width = params.height, params.width
        elif kind in ("resized_center_crop", "random_resized_crop_with_fixed_aspect_ratio"):
            height, width = params.crop_height, params.crop_width
        elif kind == "grayscale":
            channels = 1
    return channels, height, width


def parameter_count(model, dims: tuple[int, int, int]) -> int:
    """Weights the experiment's layers hold on samples of `dims`, walking the layer chain."""
    channels, height, width = dims
    flat, total = None, 0
    for layer in model.layer:  # the front end lists the chain in graph order
        kind = layer.WhichOneof("layer_type")
        if kind == "convolution":
            conv = layer.convolution
            (kernel, _), (stride, _), (pad, _) = conv.kernel_size, conv.stride, conv.padding
            total += channels * conv.out_channels * kernel * kernel + conv.out_channels * conv.has_bias.value
            channels = conv.out_channels
            height, width = ((n + 2 * pad - kernel) // stride + 1 for n in (height, width))
        elif kind == "pooling":
            pool = layer.pooling
            height, width = ((n - pool.pool_dims_i) // pool.pool_strides_i + 1 for n in (height, width))
        elif kind == "fully_connected":
            inputs = flat if flat is not None else channels * height * width
            total += inputs * layer.fully_connected.num_neurons + layer.fully_connected.num_neurons
            flat = layer.fully_connected.num_neurons
    return total


# -- what the recipe says, from the workload's PyTorch model and the recipe's fields ------------------


def expected_model_lines(recipe, classes: int) -> list[str]:
    import torch
    from torch import nn

    from repro.workloads.vgg16 import build_vgg16

    with torch.device("meta"):
        model = build_vgg16(recipe.model, classes)
    lines = ["input samples"]
    zero = "constant(0)"
    for module in model:
        if isinstance(module, nn.Conv2d):
            std = nn.init.calculate_gain("relu") / nn.init._calculate_correct_fan(module.weight, "fan_out") ** 0.5
            (k, _), (s, _), (p, _) = module.kernel_size, module.stride, module.padding
            lines.append(f"convolution out_channels={module.out_channels} kernel_size={[k, k]} stride={[s, s]} "
                         f"padding={[p, p]} bias=True normal(mean=0, std={std:.6g}) {zero}")
        elif isinstance(module, nn.Linear):
            lines.append(f"fully_connected num_neurons={module.out_features} bias=True normal(mean=0, std=0.01) {zero}")
        elif isinstance(module, nn.MaxPool2d):
            lines.append(f"pooling max dims={module.kernel_size} strides={module.stride}")
        elif isinstance(module, nn.ReLU):
            lines.append("relu")
        elif isinstance(module, nn.Dropout):
            lines.append(f"dropout keep_prob={1 - module.p:.6g}")
        else:  # LBANN's fully connected layer flattens; the pool is the identity at pool_size (check())
            assert isinstance(module, (nn.Flatten, nn.AdaptiveAvgPool2d))
    lines.append("softmax")
    lines = [f"{i:02d} {line}" for i, line in enumerate(lines)]
    lines += ["head cross_entropy(softmax, input)", "head categorical_accuracy(softmax, input)",
              "objective cross_entropy x1", "metric accuracy categorical_accuracy unit='%'",
              "metric cross_entropy cross_entropy unit=''",
              "callback print", "callback timer", "callback gpu_memory_usage", f"epochs {recipe.train.epochs}"]
    optimizer = recipe.optimizer()
    if optimizer.weight_decay:  # LBANN's L2 term (scale/2 |w|^2) has PyTorch's weight-decay gradient
        lines.append(f"objective l2 x{optimizer.weight_decay:.6g} weights=[]")
    if recipe.train.grad_clip:
        lines.append(f"callback clip_gradient_norm global_norm=True value={recipe.train.grad_clip:.6g}")
    return lines


# LBANN's own ImageNet reader (applications/vision/data/imagenet/data_reader.prototext at v0.104),
# its transforms as run_lines() writes them.
IMAGENET_NORMALIZE = "normalize_to_lbann_layout {'means': '0.406 0.456 0.485', 'stddevs': '0.225 0.224 0.229'}"
TRANSFORMS = {
    ("imagenet", "train"): ["random_resized_crop {'height': 224, 'width': 224}", "horizontal_flip {'p': 0.5}",
                            "colorize {}", IMAGENET_NORMALIZE],
    ("imagenet", "validate"): [
        "resized_center_crop {'height': 256, 'width': 256, 'crop_height': 224, 'crop_width': 224}",
        "colorize {}", IMAGENET_NORMALIZE],
}
# Digits are 32x32 RGB already: a resize sets the reader's sample size (else 256x256), nothing else moves.
DIGITS = ["resize {'height': 32, 'width': 32}", "colorize {}",
          "normalize_to_lbann_layout {'means': '0.5 0.5 0.5', 'stddevs': '0.5 0.5 0.5'}"]
TRANSFORMS[("digits", "train")] = TRANSFORMS[("digits", "validate")] = DIGITS


def expected_run_lines(recipe, classes: int) -> list[str]:
    optimizer = recipe.optimizer()
    if optimizer.name == "sgd":
        fields = {"learn_rate": optimizer.lr, "momentum": optimizer.momentum}
    else:
        fields = {"learn_rate": optimizer.lr, "beta1": optimizer.betas[0], "beta2": optimizer.betas[1],
                  "eps": optimizer.eps}
    lines = [f"trainer mini_batch_size={recipe.train.batch_per_gpu * recipe.run.gpus} random_seed={recipe.seed}",
             f"optimizer {optimizer.name} {fields}"]
    for role, split in (("train", "train"), ("validate", "val")):
        lines.append(f"reader {role} imagenet shuffle={role == 'train'} dir=/data/set/{split}/ "
                     f"list=/runs/r/lbann/{split}.txt labels={classes} fraction=1")
        lines += [f"reader {role} transform {i} {t}" for i, t in enumerate(TRANSFORMS[(recipe.data.dataset, role)])]
    return lines


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory):
    """lbann_pb2 compiled by the kit's own protoc (grpcio-tools) for the kit's protobuf runtime."""
    out = compile_schema(Path(sys.executable), tmp_path_factory.mktemp("schema") / "pb2")
    sys.path.insert(0, str(out))
    try:
        import lbann_pb2

        yield lbann_pb2
    finally:
        sys.path.remove(str(out))


RECIPES = {  # id: (scale, overrides, classes)
    "smoke-1gpu": ("smoke", ["run.gpus=1"], 10),
    "smoke-4gpus-clip": ("smoke", ["run.gpus=4", "run.nodes=2", "train.grad_clip=1.0"], 10),
    "paper-1gpu": ("paper", ["run.gpus=1", "train.precision=fp32"], 1000),
    "paper-8gpus": ("paper", ["run.gpus=8", "run.nodes=2", "train.precision=fp32"], 1000),
}


@pytest.mark.parametrize("case", RECIPES)
def test_frontend_exports_what_the_recipe_says(case: str, schema, frontend, tmp_path: Path, monkeypatch) -> None:
    from google.protobuf import text_format

    scale, overrides, classes = RECIPES[case]
    recipe = load_file(recipe_path("vgg16", scale), ["run.framework=lbann", *overrides])
    text = export(recipe_plan(recipe, classes), tmp_path, frontend, monkeypatch).read_text()
    experiment = text_format.Parse(text, schema.LbannPB())  # raises on any name the schema lacks
    assert sorted(model_lines(experiment.model)) == sorted(expected_model_lines(recipe, classes))
    assert sorted(run_lines(experiment)) == sorted(expected_run_lines(recipe, classes))
    size = recipe.model.image_size
    for reader in experiment.data_reader.reader:
        assert sample_dims(reader) == (3, size, size)
    parameters = parameter_count(experiment.model, (3, size, size))
    assert parameters == (138_357_544 if scale == "paper" else 256_690)  # torchvision's vgg16; the workload's
    assert len(experiment.model.weights) == 2 * (13 + 3)  # a kernel and a bias per convolution and linear layer


def test_a_misspelled_transform_fails_the_export(frontend, tmp_path: Path, monkeypatch) -> None:
    misspelt = recipe_plan(load_file(recipe_path("vgg16", "smoke"), ["run.framework=lbann"]), 10)
    misspelt["readers"][0]["transforms"][1] = {"colourize": {}}
    with pytest.raises(subprocess.CalledProcessError):
        export(misspelt, tmp_path, frontend, monkeypatch)
    assert not (tmp_path / "experiment.prototext").exists()
