"""PipeDream: an asynchronous 1F1B pipeline with weight stashing, on torch.distributed point-to-point.

No maintained library ships PipeDream's schedule (DeepSpeed, Megatron and torch.distributed.pipelining
all flush), and the original runtime needs PyTorch 1.1-1.4, so its semantics are implemented here,
one process per stage, activations and gradients sent with `isend`/`recv` (gloo on CPU as in the
paper's runs; the loop picks NCCL on CUDA, recorded in the start event):

- Stage s of S admits S-1-s warm-up forwards, then alternates one forward and one backward with no
  flush; every backward is followed by that stage's optimizer step, so stage s runs S-1-s updates
  behind the last stage.
- Weight stashing: a forward runs on a snapshot of the stage's parameters (a version), and the
  backward differentiates the very graph built on that snapshot, so it uses exactly the weights its
  forward used; the gradient is then applied to the live parameters. Stage s holds S-s versions.
- Vertical sync (`pipedream.vertical_sync`): the version number stage 0 used travels with each
  activation, and every stage runs that mini-batch on its own weights of that version.
- Partition: the recipe's `pipedream.balance`, else per-layer forward+backward time measured on
  rank 0 on one training mini-batch and balanced to minimise the slowest stage (recorded).
- Batch rule (the paper's): the mini-batch size is fixed (`train.batch_per_gpu`), whatever the GPU
  count; more GPUs make the pipeline deeper, not the batch larger. FP32 only.

Where this differs from the original runtime:
- The training loop calls `train_step` once per mini-batch. Each call admits one mini-batch
  (its forward on every stage) and runs the backward of the oldest mini-batch a stage holds beyond
  its S-1-s warm-up allowance; `end_epoch` runs the outstanding backwards, as the original's
  training loop does before validating. Stages run in lock step through blocking receives; the
  original overlapped communication and compute on helper threads. The per-stage order of forwards,
  backwards and updates, hence the arithmetic, is PipeDream's.
- No data-parallel replicas of a stage (PipeDream's hybrid), and the partitioner balances compute
  time only (the original's also weighed communication and memory).
- GPT-2's head is tied to the embedding; on different stages, which update at different times,
  the two train as separate copies that start equal (the original never ran tied models). With one
  stage they stay tied.
- Every stage's loader reads each mini-batch (data shard (0, 1)); stage 0 uses the inputs and the
  last stage the targets. The step loss is the last stage's, of the mini-batch just admitted.
- Gradient clipping, when a recipe asks for it, clips each stage's gradient norm on its own.

Checkpoints: each stage writes its own file (`pipedream-stage{s}.pt`): live parameters, optimizer
state, version counter, stashed weight versions, and its in-flight mini-batches. A stop between two
steps (SIGTERM mid-epoch) does not drain the pipeline: an uninterrupted run would not have drained
there, and draining would apply updates out of PipeDream's order. Instead the pipeline is saved as
it stands: each in-flight mini-batch keeps the input the stage received, the version its forward
ran on and the state of the random generator before that forward; the one gradient in transit
between neighbouring stages is received before saving and kept with the mini-batch it belongs to.
Resuming reruns those forwards on the stashed weights with the saved generator state, which
rebuilds the very graphs (bit for bit, deterministic kernels), so the run continues exactly as if
never stopped. At an epoch end the pipeline is drained anyway and no mini-batch is in flight.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from repro.adapters import pipeline
from repro.adapters.base import Adapter, Reduction
from repro.adapters.pipedream_plan import PipeDreamPlan
from repro.checkpoint import atomic_torch_save
from repro.communication import CallCounter
from repro.metrics import tensor_bytes
from repro.optim import make_optimizer

HEADER = 8  # int64 slots sent before an activation: version, number of dims, up to 6 sizes
TRACE_LENGTH = 4096  # most recent forward/backward records kept for inspection


@dataclass
class InFlight:
    """A mini-batch whose forward ran on this stage and whose backward has not."""

    minibatch: int
    version: int
    inputs: torch.Tensor  # what the stage received (requires grad except on stage 0)
    output: torch.Tensor  # the stage's output; the loss on the last stage
    params: dict[str, torch.Tensor]  # the stashed weights the forward ran on
    random_state: torch.Tensor  # the device generator's state before the forward (to rerun it)
    grad_output: torch.Tensor | None = None  # the next stage's gradient, when received before a checkpoint

    def saved(self) -> dict[str, Any]:
        """What rebuilds this mini-batch after a restart (its graph cannot be saved, only rerun)."""
        return {"minibatch": self.minibatch, "version": self.version, "inputs": self.inputs.detach(),
                "params": self.params, "random_state": self.random_state, "grad_output": self.grad_output}


class PipeDreamAdapter(PipeDreamPlan, Adapter):
    # -- setup ------------------------------------------------------------------------------------
    def setup(self, model: nn.Sequential) -> None:
        self.stages, self.stage = self.ctx.world, self.ctx.rank
        self.out_of_place = pipeline.disable_inplace(model)
        self.balance = self.options.balance or self.measured_balance(model)
        pipeline.check_balance(self.balance, len(model), self.stages)
        untied = pipeline.untie(model, pipeline.group_of_layers(self.balance))
        self.untied = pipeline.tied_names(model, untied)
        start = sum(self.balance[: self.stage])
        self.model = model[start : start + self.balance[self.stage]].to(self.ctx.device)
        self.live = dict(self.model.named_parameters())
        # a stage of parameter-free layers (a pooling layer, say) can come out of a time balance
        self.optimizer = make_optimizer(self.ctx.recipe.optimizer(), self.live.values()) if self.live else None
        self.version = 0  # updates this stage has applied
        self.versions = {0: self.snapshot()}
        self.stash_peak = 0  # bytes of stashed weight versions at their peak (stashed_bytes)
        self.in_flight: deque[InFlight] = deque()
        self.admitted = 0
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.communication = CallCounter()  # its isends outlive the step: no profiler (repro.communication)
        self.trace: deque[dict[str, Any]] = deque(maxlen=TRACE_LENGTH)

    def measured_balance(self, model: nn.Sequential) -> list[int]:
        """Rank 0 times each layer on one mini-batch and balances; every rank uses its answer."""
        if self.stages == 1:
            return [len(model)]
        balance = [None]
        if self.ctx.rank == 0:
            sample = pipeline.sample_inputs(self.ctx.workload, self.ctx.recipe.train.batch_per_gpu)
            times = pipeline.layer_times(model.to(self.ctx.device), sample.to(self.ctx.device))
            balance = [pipeline.balance_costs(times, self.stages)]
        dist.broadcast_object_list(balance, src=0)
        return balance[0]

    def facts(self) -> dict[str, Any]:
        return {
            "balance": self.balance, "balance_by": "recipe" if self.options.balance else "time",
            "vertical_sync": self.options.vertical_sync, "stages": self.stages,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "untied": self.untied, "inplace_made_out_of_place": self.out_of_place,
        }

    @property
    def warmup(self) -> int:
        """Forwards this stage runs ahead of its backwards."""
        return self.stages - 1 - self.stage

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def reporting_rank(self) -> int:
        return self.ctx.world - 1

    def data_shard(self) -> tuple[int, int]:
        return 0, 1

    # -- weight versions ----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, torch.Tensor]:
        # Parameters, so that activation counting (repro.activation) leaves stashed weights out
        return {name: nn.Parameter(p.detach().clone(), p.requires_grad) for name, p in self.live.items()}

    def weights_for(self, tag: int) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, weights) a new forward runs on; drops versions no later forward can ask for."""
        version = tag if self.options.vertical_sync else self.version
        for old in [v for v in self.versions if v < version]:
            del self.versions[old]
        return version, self.versions[version]

    # -- point-to-point messages --------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, peer: int) -> None:
        tensor = tensor.detach().contiguous()
        self.sends.append((dist.isend(tensor, peer), tensor))

    def flush_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()

    def send_activation(self, tensor: torch.Tensor, version: int) -> None:
        header = torch.zeros(HEADER, dtype=torch.int64, device=self.ctx.device)
        header[0], header[1] = version, tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape)
        self.isend(header, self.stage + 1)
        self.isend(tensor, self.stage + 1)

    def receive_activation(self) -> tuple[torch.Tensor, int]:
        header = torch.empty(HEADER, dtype=torch.int64, device=self.ctx.device)
        dist.recv(header, self.stage - 1)
        version, dims = int(header[0]), int(header[1])
        tensor = torch.empty(header[2 : 2 + dims].tolist(), device=self.ctx.device)
        dist.recv(tensor, self.stage - 1)
        return tensor, version

    # -- training -----------------------------------------------------------------------------------
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        self.flush_sends()
        admitted = self.forward_pass(inputs, targets)
        if self.admitted <= 2 * self.stages:  # steady from forward 2S - 1 on stage 0; later steps are timed
            self.stash_peak = max(self.stash_peak, self.stashed_bytes())
        while len(self.in_flight) > self.warmup:
            self.backward_oldest()
        return self.shard_loss(admitted.output) if self.last else None

    def stashed_bytes(self) -> int:
        """Bytes of the weight versions this stage holds besides its live weights: the snapshots its
        in-flight forwards ran on and the newest one (the next forward's)."""
        versions = [*self.versions.values(), *(entry.params for entry in self.in_flight)]
        return tensor_bytes(t for version in versions for t in version.values())

    def model_state_bytes(self) -> dict[str, int]:
        """Live weights, gradients and optimizer state, and with the weights the stashed versions at their
        peak over the first 2 S steps (weight stashing is what PipeDream holds beyond a plain stage: S - s
        versions once every in-flight forward ran on its own version, from stage 0's forward 2 S - 1 on)."""
        state = super().model_state_bytes()
        return {**state, "parameters": state["parameters"] + self.stash_peak}

    def reduce_losses(self, losses: list[torch.Tensor | None]) -> Reduction | None:
        return pipeline.last_stage_losses(losses)

    def end_epoch(self) -> None:
        while self.in_flight:
            self.backward_oldest()
        self.flush_sends()

    def forward_pass(self, inputs: torch.Tensor, targets: torch.Tensor) -> InFlight:
        if self.first:
            x, tag = inputs.to(self.ctx.device), self.version
        else:
            x, tag = self.receive_activation()
            x.requires_grad_()
        version, params = self.weights_for(tag)
        random_state = self.random_state()
        output = functional_call(self.model, params, (x,))
        if self.last:
            output = self.ctx.workload.loss(output, targets.to(self.ctx.device))
        else:
            self.send_activation(output, version)
        entry = InFlight(self.admitted, version, x, output, params, random_state)
        self.trace.append({"minibatch": self.admitted, "phase": "forward", "version": version, "live": self.version})
        self.in_flight.append(entry)
        self.admitted += 1
        return entry

    def backward_oldest(self) -> None:
        entry = self.in_flight.popleft()
        grad_output = entry.grad_output
        if grad_output is None and not self.last:
            grad_output = self.receive_gradient(entry)
        wrt = [*entry.params.values(), *([] if self.first else [entry.inputs])]
        grads = torch.autograd.grad(entry.output, wrt, grad_output) if wrt else ()
        if not self.first:
            self.isend(grads[-1], self.stage - 1)
        self.trace.append(
            {"minibatch": entry.minibatch, "phase": "backward", "version": entry.version, "live": self.version}
        )
        if self.optimizer:
            for param, grad in zip(self.live.values(), grads):
                param.grad = grad
            self.clip_gradients(self.live.values())
            self.optimizer.step()
        self.version += 1  # counted on parameter-free stages too, so version tags agree across stages
        self.versions[self.version] = self.snapshot()

    def receive_gradient(self, entry: InFlight) -> torch.Tensor:
        grad_output = torch.empty_like(entry.output)
        dist.recv(grad_output, self.stage + 1)
        return grad_output

    # -- checkpoints: every stage saves its own state, in-flight mini-batches included -----------------
    def checkpoint_file(self, folder: Path) -> Path:
        return folder / f"pipedream-stage{self.stage}.pt"

    def random_state(self) -> torch.Tensor:
        """State of the generator this stage's random layers (dropout) draw from."""
        if self.ctx.device.type == "cuda":
            return torch.cuda.get_rng_state(self.ctx.device)
        return torch.get_rng_state()

    def set_random_state(self, state: torch.Tensor) -> None:
        if self.ctx.device.type == "cuda":
            torch.cuda.set_rng_state(state.cpu(), self.ctx.device)
        else:
            torch.set_rng_state(state.cpu())

    def receive_gradient_in_transit(self) -> None:
        """Between two steps, stage s+1 has sent the gradient of stage s's oldest in-flight mini-batch
        once stage s holds its full warm-up allowance (stage s+1 runs that backward one step earlier);
        receive it now so that no message is left between the stages."""
        if not self.last and len(self.in_flight) == self.warmup and self.in_flight[0].grad_output is None:
            self.in_flight[0].grad_output = self.receive_gradient(self.in_flight[0])

    def save_checkpoint(self, folder: Path) -> None:
        self.receive_gradient_in_transit()
        self.flush_sends()
        state = {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "version": self.version, "versions": self.versions, "admitted": self.admitted,
            "in_flight": [entry.saved() for entry in self.in_flight], "trace": list(self.trace),
        }
        atomic_torch_save(state, self.checkpoint_file(folder))

    def load_checkpoint(self, folder: Path) -> None:
        state = torch.load(self.checkpoint_file(folder), map_location=self.ctx.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        if self.optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        self.version, self.versions, self.admitted = state["version"], state["versions"], state["admitted"]
        self.in_flight = deque(self.rerun_forward(saved) for saved in state["in_flight"])
        self.trace = deque(state["trace"], maxlen=TRACE_LENGTH)

    def rerun_forward(self, saved: dict[str, Any]) -> InFlight:
        """Rebuild an in-flight mini-batch's graph: its forward again, on the same input, stashed weights
        and random state. Never on the last stage, which holds no mini-batch between steps."""
        devices = [self.ctx.device] if self.ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the loop restores the generators afterwards anyway
            self.set_random_state(saved["random_state"])
            inputs = saved["inputs"] if self.first else saved["inputs"].requires_grad_()
            output = functional_call(self.model, saved["params"], (inputs,))
        return InFlight(saved["minibatch"], saved["version"], inputs, output, saved["params"],
                        saved["random_state"], saved["grad_output"])

    # -- evaluation: activations pass through the stages on the live weights ------------------------
    def forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        self.flush_sends()
        x = inputs.to(self.ctx.device) if self.first else self.receive_activation()[0]
        output = self.model(x)
        if self.last:
            return output
        self.send_activation(output, self.version)
        return None

    def teardown(self) -> None:
        """Complete every message, then wait for all stages, so no stage closes its connections while
        a peer still talks to it (measured: gloo then aborted a stage at exit now and then)."""
        self.flush_sends()
        if dist.is_initialized():
            dist.barrier()
