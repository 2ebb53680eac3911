"""DeepSpeed ZeRO, stages 1-3: data parallelism that partitions model state over the ranks.

Stage 1 partitions the optimizer state (with its fp32 master copy of the weights), stage 2 also
the gradients, stage 3 also the parameters. The model is handed to `deepspeed.initialize` with the
kit's optimizer (repro.optim: the same torch.optim.Adam that DDP steps, so losses equal DDP's;
DeepSpeed's FusedAdam needs CUDA, and its "Adam" config type decouples weight decay by default),
and each step is the engine's own forward, backward and step. DeepSpeed picks its accelerator
(CUDA, or its CPU accelerator with gloo) by itself and joins the loop's process group.

Every setting that changes the arithmetic comes from the recipe: gradient clipping from
train.grad_clip (0 when null: DeepSpeed 0.19 defaults `gradient_clipping` to 1.0), bf16
from train.precision through DeepSpeed's torch_autocast (the autocast DDP uses, fp32 weights, rather
than DeepSpeed's bf16 mode, which trains a half-precision copy of the model), fp16 through DeepSpeed's
own `fp16` mode with dynamic loss scaling (FP16_CONFIG; why not autocast: FP16_CONFIG's comment), bucket
sizes from the `zero:` section. The resolved DeepSpeed configuration is written to the run folder
(CONFIG_FILE) and recorded with the run. What the model-state count includes: docs/memory.md.

Memory settings (issue 39): train.micro_batch becomes DeepSpeed's train_micro_batch_size_per_gpu and
gradient_accumulation_steps; the adapter calls engine.backward and engine.step once per micro-batch, as
DeepSpeed expects: backward scales the loss by 1 / gradient_accumulation_steps, and step updates the
weights only at the accumulation boundary (the last micro-batch). train.recompute=full runs the
workload's blocks under torch.utils.checkpoint (repro.adapters.recompute), not deepspeed.checkpointing:
that is Megatron's reentrant checkpoint, which the model must call itself and which restores the CUDA
generator through a model-parallel RNG tracker (`configure(mpu_, ...)`), while DeepSpeed's
`activation_checkpointing` config only tunes those calls; torch's non-reentrant checkpoint needs no model
change, restores the CPU and CUDA RNG states, and is the one the DDP cells and the activation counter
(Counter.recomputation) already hold to the byte.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from repro.adapters.base import Adapter
from repro.adapters.recompute import apply_recompute
from repro.adapters.zero_plan import ZeroPlan, extension_folder
from repro.metrics import optimizer_tensors, tensor_bytes
from repro.optim import make_optimizer

CONFIG_FILE = "deepspeed_config.json"
CHECKPOINT_TAG = "zero"  # the subfolder of a loop checkpoint that holds DeepSpeed's files
# fp16: DeepSpeed's own mode, as its fp16 users train (deepspeed/runtime/precision_config.py,
# DeepSpeedFP16Config): the model in fp16, fp32 master weights in the ZeRO optimizer, and dynamic loss
# scaling (loss_scale 0) by runtime/fp16/loss_scaler.py's DynamicLossScaler: an overflow anywhere skips
# the step on every rank and halves the scale; loss_scale_window steps without one double it. Not
# torch_autocast with float16: DeepSpeed 0.19 gives that a GradScaler only without ZeRO
# (runtime/engine.py, `torch_autocast_z0_gradscaler`), so under ZeRO its gradients would go unscaled.
# auto_cast casts floating inputs (VGG-16's images) to the model's fp16. The rest are DeepSpeed's defaults.
FP16_CONFIG = {"enabled": True, "auto_cast": True, "loss_scale": 0, "initial_scale_power": 16,
               "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
AUTOCAST_DTYPES = {"bf16": "bfloat16"}
# Model state peaks from the second step on (the optimizer allocates its state in the first); counting
# only the first steps keeps the count's cost (milliseconds under stage 3) out of later timed steps.
COUNTED_STEPS = 3


class ZeroAdapter(ZeroPlan, Adapter):
    def deepspeed_config(self) -> dict[str, Any]:
        """The configuration handed to deepspeed.initialize, every arithmetic setting explicit."""
        recipe, options = self.ctx.recipe, self.options
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": recipe.train.micro_batch or recipe.train.batch_per_gpu,
            "gradient_accumulation_steps": self.accumulation_steps(recipe),
            "gradient_clipping": recipe.train.grad_clip or 0.0,
            "zero_optimization": {
                "stage": options.stage,
                "reduce_bucket_size": options.reduce_bucket_size,
                "allgather_bucket_size": options.allgather_bucket_size,
                "overlap_comm": options.overlap_comm,
                "contiguous_gradients": options.contiguous_gradients,
                "stage3_param_persistence_threshold": options.param_persistence_threshold,
                "stage3_prefetch_bucket_size": options.prefetch_bucket_size,
            },
            "steps_per_print": 2**31 - 1,
        }
        if recipe.train.precision == "fp16":
            config["fp16"] = FP16_CONFIG
        if recipe.train.precision in AUTOCAST_DTYPES:
            config["torch_autocast"] = {"enabled": True, "dtype": AUTOCAST_DTYPES[recipe.train.precision]}
        return config

    def setup(self, model: nn.Sequential) -> None:
        import deepspeed

        programs_beside_python_on_path()
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extension_folder()))  # a folder the user set wins
        model = model.to(self.ctx.device)
        self.recomputed = apply_recompute(model, self.ctx.recipe, self.recompute(self.ctx.recipe), self.activations, self.flops)
        optimizer = make_optimizer(self.ctx.recipe.optimizer(), model.parameters())
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.deepspeed_config(), dist_init_required=False,
        )
        self.model = self.engine
        self.peak_model_state = {"parameters": 0, "gradients": 0, "optimizer": 0}
        self.steps_counted = 0
        if self.ctx.rank == 0 and self.ctx.run_dir:
            (self.ctx.run_dir / CONFIG_FILE).write_text(json.dumps(resolved_config(self.engine), indent=2, sort_keys=True))

    def facts(self) -> dict[str, Any]:
        return {"recomputed_blocks": self.recomputed} if self.recomputed else {}  # without recompute: as before

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
        steps = self.accumulation_steps(self.ctx.recipe)
        losses = [self.micro_step(part, target) for part, target in zip(inputs.chunk(steps), targets.chunk(steps))]
        self.steps_counted += 1
        return self.shard_loss(losses[0] if steps == 1 else torch.stack(losses).mean())

    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One micro-batch through the engine: DeepSpeed scales its loss and steps at the accumulation boundary."""
        loss = self.ctx.workload.loss(self.engine(inputs), targets)
        if self.steps_counted < COUNTED_STEPS:
            loss.register_hook(self._measure_when_backward_ends)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def _measure_when_backward_ends(self, grad: torch.Tensor) -> None:
        """Runs as backward starts; queues the count for when autograd has produced every gradient."""
        torch.autograd.Variable._execution_engine.queue_callback(self._record_model_state)

    def _record_model_state(self) -> None:
        state = zero_model_state(self.engine)
        if sum(state.values()) > sum(self.peak_model_state.values()):
            self.peak_model_state = state

    def model_state_bytes(self) -> dict[str, int]:
        """Model state at its high-water mark in a step: the end of backward, before DeepSpeed's own
        gradient reduction and the optimizer step, when parameters, every gradient ZeRO still holds and
        the optimizer state are all alive (the largest count over the first COUNTED_STEPS steps)."""
        return self.peak_model_state

    def save_checkpoint(self, folder: Path) -> None:
        """DeepSpeed's own checkpoint, every rank writing its partition: the module (data-parallel rank 0;
        under stage 3 each rank its parameter partition) and each rank's optimizer partition with its fp32
        master weights. With the default (non-decoupled) checkpoint engine the files are written and
        committed, and the ranks have met at DeepSpeed's closing barrier, when this returns."""
        self.engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, save_latest=False)

    def load_checkpoint(self, folder: Path) -> None:
        """Module, optimizer partitions (master weights, Adam moments, step counts) and engine counters."""
        path, _ = self.engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_optimizer_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {CHECKPOINT_TAG!r} in {folder}")

    def teardown(self) -> None:
        self.engine.destroy()


def resolved_config(engine: Any) -> dict[str, Any]:
    """What DeepSpeed made of our configuration: every field of its parsed config, defaults included."""
    config = engine._config

    def plain(value: Any) -> Any:
        if hasattr(value, "model_dump"):
            return value.model_dump()
        if isinstance(value, (str, int, float, bool)) or value is None:
            return value
        if isinstance(value, dict):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return repr(value)

    return {key: plain(value) for key, value in vars(config).items() if not key.startswith("_")}


def zero_model_state(engine: Any) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds under ZeRO, from its tensors.

    parameters: the storage behind the model's parameters (stage 1-2: the flat buffer holding the
      whole model; stage 3: this rank's partition, `ds_tensor`, plus any parameter gathered whole).
    optimizer: the inner optimizer's state and the tensors it updates, ZeRO's fp32 master partition of
      the weights (as in the ZeRO paper's K = 12 bytes per parameter for mixed-precision Adam).
    gradients: every other tensor the ZeRO optimizer holds (gradient partitions, reduction buckets)
      and the `.grad` of model and master tensors.
    Storages are counted once, in that order (a tensor shared between categories counts in the first).
    """
    zero = engine.optimizer
    inner = zero.optimizer
    params = list(engine.module.parameters())
    weights = [t for p in params for t in (p.data, getattr(p, "ds_tensor", None))]
    # the master partition: what the inner optimizer steps (stage 3 empties its param groups between steps)
    master = [p for group in inner.param_groups for p in group["params"]] + list(inner.state)
    optimizer = master + optimizer_tensors(inner)
    gradients = [p.grad for p in params + master] + list(reachable_tensors(zero))
    counted = [tensor_bytes(weights), tensor_bytes(weights + optimizer), tensor_bytes(weights + optimizer + gradients)]
    return {
        "parameters": counted[0],
        "optimizer": counted[1] - counted[0],
        "gradients": counted[2] - counted[1],
    }


def reachable_tensors(root: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    """Tensors held by `root` through attributes, lists, tuples and dicts (keys too), `depth` levels deep.

    Only DeepSpeed's own objects are entered, so modules, process groups and torch internals are not walked.
    """
    if isinstance(root, torch.Tensor):
        yield root
    elif depth == 0:
        return
    elif isinstance(root, dict):
        for key, value in root.items():
            yield from reachable_tensors(key, depth - 1)
            yield from reachable_tensors(value, depth - 1)
    elif isinstance(root, (list, tuple)):
        for value in root:
            yield from reachable_tensors(value, depth - 1)
    elif type(root).__module__.startswith("deepspeed.") and hasattr(root, "__dict__"):
        for value in vars(root).values():
            yield from reachable_tensors(value, depth - 1)


def build_cpu_extension() -> None:
    """Build DeepSpeed's shared-memory op where a ZeRO rank would load it, as a rank's `setup` does
    (deepspeed/comm/torch.py, build_shm_op: nothing on an accelerator that has no such op)."""
    from deepspeed.comm.torch import build_shm_op

    programs_beside_python_on_path()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extension_folder()))
    build_shm_op()


def programs_beside_python_on_path() -> None:
    """On CPU, DeepSpeed JIT-builds its shared-memory op (deepspeed/comm/torch.py, build_shm_op), and torch's
    builder runs `ninja` from PATH (torch/utils/cpp_extension.py, verify_ninja_availability). Where PATH has
    none (a fresh machine, the kit run as .venv/bin/repro without the virtualenv activated), the pinned ninja
    beside this Python is used. A ninja already on PATH is kept: ninja versions write different build logs,
    and a switch between two rebuilds the op (35 s here)."""
    if shutil.which("ninja") is None:
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
