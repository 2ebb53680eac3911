"""The adapter interface: the only place where a framework appears.

The cut follows where frameworks really differ (see ../shared/docs/STYLE.md): an adapter builds
model and optimizer together, runs one whole training step (forward, backward, optimizer step)
because DeepSpeed and pipeline schedules fuse them, evaluates one batch, says which rank reports
the loss and which shard of each global batch its rank consumes, counts the model state its
rank holds, and saves and restores its training state in its framework's own way (or declares
that state replicated, to use the base checkpoint). The training loop (repro.loop) never branches on
the framework.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from repro import launch
from repro.activation import Counter
from repro.checkpoint import atomic_torch_save
from repro.communication import CommCounter
from repro.metrics import model_state
from repro.schema import RecipeError
from repro.recipe import FrameworkOptions, Recipe
from repro.workloads import Workload

ADAPTER_STATE_FILE = "adapter.pt"


def parameter_users(modules: Sequence[nn.Module]) -> dict[nn.Parameter, set[int]]:
    """Each parameter of `modules` -> the indices of the modules that hold it (tied weights have several)."""
    users: dict[nn.Parameter, set[int]] = {}
    for index, module in enumerate(modules):
        for param in module.parameters():
            users.setdefault(param, set()).add(index)
    return users


@dataclass
class RunContext:
    """What a rank knows about its run."""

    recipe: Recipe
    workload: Workload
    rank: int
    world: int
    local_rank: int
    device: torch.device
    seeds: dict[str, int] = field(default_factory=dict)
    run_dir: Path | None = None  # files a rank writes here are recorded with the run


class Reduction:
    """A collective's result, read once every rank has joined it (`result`): the loop starts the
    reduction of a window's losses after one step and reads it after the next, so it waits neither
    for a peer that is a little behind nor, on a GPU, for the collective itself."""

    def __init__(self, tensor: torch.Tensor, work: dist.Work | None = None, divisor: int = 1):
        self.tensor, self.work, self.divisor = tensor, work, divisor

    def result(self) -> torch.Tensor:
        """The reduced tensor (divided by `divisor`: a mean), once the collective has finished."""
        if self.work is not None:
            self.work.wait()  # on a GPU: the current stream waits for it, the host does not
        if self.divisor != 1:
            self.tensor /= self.divisor
        return self.tensor


class Adapter:
    """Base class. Subclasses implement `setup` and `train_step`; the rest has data-parallel defaults."""

    Options: type = FrameworkOptions

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.options = ctx.recipe.options()
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.activations = Counter()  # the loop runs its first steps inside its hooks(); torchgpipe counts per partition
        self.communication = CommCounter()  # the loop counts one warm-up step; torchgpipe counts its partition boundaries

    # -- class-level facts, used before any process starts ------------------------------------
    workloads: tuple[str, ...] = ("vgg16", "gpt2")  # the workloads this framework applies to
    not_applicable_because: str = ""  # why it does not apply to the others

    @classmethod
    def check_workload(cls, recipe: Recipe, source: str) -> None:
        """One line saying why this framework does not apply to the recipe's workload, if it does not."""
        if recipe.workload not in cls.workloads:
            raise RecipeError(source, "run.framework", f"{recipe.run.framework} is not applicable to "
                              f"{recipe.workload}: {cls.not_applicable_because}")

    # Whether every rank holds the same, whole training state after each step (data parallelism, or a
    # single process). Only then does the base checkpoint (rank 0's state_dict) restore every rank;
    # an adapter whose ranks hold different state must bring its own save/load_checkpoint.
    replicated_state: bool = False

    @classmethod
    def no_checkpoint_because(cls, framework: str) -> str:
        """Why this adapter can make no checkpoint, in one line naming `framework` (empty when it can)."""
        if cls.replicated_state or cls.save_checkpoint is not Adapter.save_checkpoint:
            return ""
        return (f"{framework} cannot checkpoint: its adapter ({cls.__module__}.{cls.__name__}) has no "
                "checkpoint of its own and does not declare its state replicated")

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        """Raise RecipeError (naming the field) when the recipe cannot run under this framework."""

    @classmethod
    def command(cls, recipe: Recipe, run_dir: Path, rdzv_endpoint: str | None = None) -> list[str]:
        """This node's command line: PyTorch's launcher starting repro.loop in every process, joined
        to the other nodes' launchers through the c10d rendezvous at `rdzv_endpoint` (HOST:PORT).

        A framework with its own runtime (LBANN) returns the command of its own driver instead,
        which must write the same events (repro.events) into `run_dir`.
        """
        processes, nodes = cls.processes(recipe), recipe.run.nodes
        if nodes == 1:
            return launch.torchrun_local(processes, run_dir)
        return launch.torchrun_node(nodes, processes // nodes, rdzv_endpoint, run_dir.name, run_dir)

    @classmethod
    def processes(cls, recipe: Recipe) -> int:
        """Processes the launcher starts for the whole job (one per GPU unless the framework drives several)."""
        return recipe.run.gpus

    @classmethod
    def global_batch(cls, recipe: Recipe) -> int:
        """Samples per optimizer step over the whole job (the paper's rule: batch per GPU x GPUs)."""
        return recipe.train.batch_per_gpu * recipe.run.gpus

    @classmethod
    def micro_batches(cls, recipe: Recipe) -> int:
        """Micro-batches each global batch is cut into (1 where the framework does not pipeline)."""
        return 1

    @classmethod
    def effective(cls, recipe: Recipe) -> dict[str, Any]:
        """What this framework really trains with, under names every framework shares (MLflow's `effective.*`)."""
        optimizer = recipe.optimizer()
        return {"optimizer": optimizer.name, "lr": optimizer.lr, "weight_decay": optimizer.weight_decay,
                "global_batch": cls.global_batch(recipe), "micro_batches": cls.micro_batches(recipe)}

    # -- per-rank behaviour --------------------------------------------------------------------
    def setup(self, model: nn.Sequential) -> None:
        raise NotImplementedError

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step on this rank's shard; returns its loss as a detached tensor on the device
        (None on ranks without one). The loop reduces a window of them at once (reduce_losses)."""
        raise NotImplementedError

    def reduce_losses(self, losses: list[torch.Tensor | None]) -> Reduction | None:
        """Each step's global mean loss from the per-shard losses of several steps, in one collective
        (started on every rank at once, read later); valid on the reporting rank, None where it has none."""
        return self.all_reduce_started(torch.stack(losses).float(), self.data_group, average=True)

    def end_epoch(self) -> None:
        """Finish the epoch's outstanding training work (an asynchronous pipeline drains here)."""

    def facts(self) -> dict[str, Any]:
        """Decisions the adapter made at setup (a computed partition, say), recorded in the start event."""
        return {}

    def pieces(self) -> dict[str, str]:
        """The implementation of each piece this rank trains with (model, data-parallel wrapper,
        optimizer...), where it depends on the device; MLflow's `effective.*` beside Adapter.effective."""
        return {}

    def data_shard(self) -> tuple[int, int]:
        """(index, count): this rank consumes shard `index` of `count` equal shards of each global batch."""
        return self.ctx.rank, self.ctx.world

    @property
    def reporting_rank(self) -> int:
        """The rank whose train_step/eval_step results are the run's (the last pipeline stage, say)."""
        return 0

    @property
    def data_group(self) -> Any:
        """The process group over which data shards are spread (None: the whole world)."""
        return None

    def set_training(self, mode: bool) -> None:
        """Switch dropout (and any such layer) between training and evaluation behaviour."""
        self.model.train(mode)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Evaluation forward pass; None on ranks that produce no output."""
        return self.model(inputs)

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """This rank's metric sums of one validation batch (None where the rank produces no output)."""
        with torch.no_grad(), self.autocast():
            output = self.forward(inputs.to(self.ctx.device))
        if output is None:
            return None
        return self.ctx.workload.metric_sums(output, targets.to(self.ctx.device))

    def reduce_metric_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """Validation sums of every shard, valid on the reporting rank (ranks without output add zeros)."""
        return self.all_reduce(sums, self.data_group)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state that this rank holds."""
        return model_state(self.model, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def save_checkpoint(self, folder: Path) -> None:
        """Write this rank's share of the training state into `folder` (called on every rank at once).

        The base checkpoint, for adapters that declare `replicated_state` only: rank 0 writes
        `state_dict()` to one file, atomically. Frameworks that shard or partition the state, or
        have their own checkpoint format (DeepSpeed's save_checkpoint), override this and
        load_checkpoint; the loop makes the folder current only after every rank has returned.
        """
        self.require_checkpoint()
        if self.ctx.rank == 0:
            atomic_torch_save(self.state_dict(), folder / ADAPTER_STATE_FILE)

    def load_checkpoint(self, folder: Path) -> None:
        """Restore what save_checkpoint wrote (called on every rank after setup)."""
        self.require_checkpoint()
        self.load_state_dict(torch.load(folder / ADAPTER_STATE_FILE, map_location=self.ctx.device))

    def require_checkpoint(self) -> None:
        reason = type(self).no_checkpoint_because(self.ctx.recipe.run.framework)
        if reason:
            raise RuntimeError(reason)

    def teardown(self) -> None:
        """Release framework resources (the loop destroys the process group afterwards)."""

    # -- helpers shared by adapters -------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision as the recipe asks (fp32: no autocast)."""
        precision = self.ctx.recipe.train.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        return torch.autocast(self.ctx.device.type, dtype=dtype)

    def clip_gradients(self, parameters: Any) -> None:
        if self.ctx.recipe.train.grad_clip:
            nn.utils.clip_grad_norm_(parameters, self.ctx.recipe.train.grad_clip)

    @staticmethod
    def all_reduce_started(tensor: torch.Tensor, group: Any = None, average: bool = False) -> Reduction:
        """`all_reduce`, started without waiting for the peers (a collective on the device's stream)."""
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            work = dist.all_reduce(tensor, group=group, async_op=True)
            return Reduction(tensor, work, dist.get_world_size(group) if average else 1)
        return Reduction(tensor)

    @staticmethod
    def all_reduce(tensor: torch.Tensor, group: Any = None, average: bool = False) -> torch.Tensor:
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, group=group)
            if average:
                tensor /= dist.get_world_size(group)
        return tensor

    @staticmethod
    def shard_loss(loss: torch.Tensor) -> torch.Tensor:
        """This shard's mean loss, kept on the device (no host synchronisation)."""
        return loss.detach().float()
