"""The adapter interface: the only place where a framework appears.

The cut follows where frameworks really differ (see ../shared/docs/STYLE.md): an adapter builds
model and optimizer together, runs one whole training step (forward, backward, optimizer step)
because DeepSpeed and pipeline schedules fuse them, evaluates one batch, says which rank reports
the loss and which shard of each global batch its rank consumes, counts the model state its
rank holds, and saves and restores its training state in its framework's own way (or declares
that state replicated, to use the base checkpoint). The training loop (repro.loop) never branches on
the framework. What the parent reads before any process starts (recipe checks, batch rule, command,
whether it can checkpoint) is the framework's plan (repro.adapters.plan), which its adapter subclasses.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from repro.activation import Counter
from repro.adapters.plan import FrameworkPlan
from repro.checkpoint import atomic_torch_save
from repro.communication import CommCounter
from repro.flops import FlopCounter
from repro.metrics import model_state
from repro.recipe import Recipe
from repro.workloads.base import Workload

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


class Adapter(FrameworkPlan):
    """Base class. Subclasses implement `setup` and `train_step`; the rest has data-parallel defaults.

    A framework's adapter subclasses its plan (repro.adapters.plan) before this class, so the class-level
    facts the parent planned with are the ones its ranks train with."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """An adapter saves and loads its own checkpoint exactly when its plan says so (the parent refuses
        --resume from the plan alone, without importing the adapter)."""
        super().__init_subclass__(**kwargs)
        both = ["save_checkpoint", "load_checkpoint"]
        overrides = [name for name in both if getattr(cls, name) is not getattr(Adapter, name)]
        if overrides != (both if cls.own_checkpoint else []):
            raise TypeError(f"{cls.__module__}.{cls.__name__}: own_checkpoint is {cls.own_checkpoint} but it overrides "
                            f"{', '.join(overrides) or 'neither save_checkpoint nor load_checkpoint'}")

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.options = ctx.recipe.options()
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.activations = Counter()  # the loop runs its first steps inside its hooks(); torchgpipe counts per partition
        self.communication = CommCounter()  # the loop counts one warm-up step; torchgpipe counts its partition boundaries
        self.flops = FlopCounter()  # the loop counts the same step

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
        optimizer...), where it depends on the device; MLflow's `effective.*` beside FrameworkPlan.effective."""
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

    def split_micro_batches(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """The step's micro-batches (train.micro_batch samples each; without it, the whole batch), each with
        whether it is the last: the one whose backward the framework reduces the gradients after."""
        steps = self.accumulation_steps(self.ctx.recipe)
        parts = list(zip(inputs.chunk(steps), targets.chunk(steps)))
        return [(part, target, index == steps - 1) for index, (part, target) in enumerate(parts)]

    def micro_batch_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The workload's loss of one micro-batch under the recipe's autocast, scaled by 1 / micro-batches so
        that the gradients summed in `.grad` over the step are the whole batch's mean."""
        with self.autocast():
            loss = self.ctx.workload.loss(self.model(inputs), targets)
        steps = self.accumulation_steps(self.ctx.recipe)
        return loss / steps if steps > 1 else loss

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
