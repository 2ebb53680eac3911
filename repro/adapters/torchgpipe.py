"""torchgpipe: GPipe's synchronous pipeline (micro-batches, then a flush) driven by one process.

One process drives all of the run's devices: `cuda:0..k-1` on a GPU machine, k `cpu` stand-ins
elsewhere. The layer list is cut into k partitions by a balance given in the recipe
(`torchgpipe.balance`) or computed by torchgpipe's own profilers (`balance_by_time`, or
`balance_by_size` on CUDA), and recorded in the run's start event.

Batch rule (the paper's): the micro-batch size is fixed (`train.batch_per_gpu` is read as the
micro-batch size) and a mini-batch has `chunks_per_gpu` (4) x GPUs micro-batches, so the global
batch is batch_per_gpu x 4 x GPUs. FP32 only, as in the paper. Single node only.

torchgpipe refuses parameters shared by two layers, so GPT-2's tied head gets its own copy whose
gradient is summed with the embedding's before each step (see repro.adapters.pipeline).

Checkpoints: the base adapter's single file. GPipe's state dict holds every partition, the head's
copy included, and the optimizer's holds the state of both copies; the two copies are equal at every
step boundary, so restoring both restores the tie.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from repro.activation import PartitionCounters
from repro.adapters import pipeline
from repro.adapters.base import Adapter
from repro.adapters.torchgpipe_plan import GPipePlan
from repro.communication import BoundaryCounter
from repro.metrics import model_state
from repro.optim import make_optimizer


class GPipeAdapter(GPipePlan, Adapter):
    def devices(self) -> list[torch.device]:
        gpus = self.ctx.recipe.run.gpus
        if self.ctx.device.type != "cuda":
            return [torch.device("cpu")] * gpus
        if torch.cuda.device_count() < gpus:
            raise RuntimeError(f"torchgpipe needs {gpus} GPUs in this process; {torch.cuda.device_count()} visible")
        return [torch.device("cuda", index) for index in range(gpus)]

    def compute_balance(self, model: nn.Sequential, devices: list[torch.device]) -> list[int]:
        from torchgpipe.balance import balance_by_size, balance_by_time

        if self.options.balance is not None:
            return list(self.options.balance)
        micro_batch = self.ctx.recipe.train.batch_per_gpu
        sample = pipeline.sample_inputs(self.ctx.workload, micro_batch)
        if self.options.balance_by == "size":
            if devices[0].type != "cuda":
                raise RuntimeError("torchgpipe.balance_by=size profiles CUDA memory; use time on CPU or give a balance")
            return balance_by_size(len(devices), model, sample, chunks=self.chunks(self.ctx.recipe), device=devices[0])
        return balance_by_time(len(devices), model, sample, device=devices[0])

    def setup(self, model: nn.Sequential) -> None:
        from torchgpipe import GPipe

        devices = self.devices()
        self.out_of_place = pipeline.disable_inplace(model)
        self.balance = self.compute_balance(model, devices)
        pipeline.check_balance(self.balance, len(model), len(devices))
        self.tied = pipeline.untie(model, range(len(model)))  # torchgpipe refuses any shared parameter
        self.tied_names = pipeline.tied_names(model, self.tied)
        self.model = GPipe(
            model, self.balance, devices=devices, chunks=self.chunks(self.ctx.recipe), checkpoint=self.options.checkpoint
        )
        self.optimizer = make_optimizer(self.ctx.recipe.optimizer(), self.model.parameters())
        self.activations = PartitionCounters(self.model.partitions)
        self.communication = BoundaryCounter(self.model.partitions)
        self.flops.watch(self.model.partitions)  # their forwards run on torchgpipe's worker threads

    def facts(self) -> dict[str, Any]:
        return {
            "balance": self.balance, "balance_by": "recipe" if self.options.balance else self.options.balance_by,
            "chunks": self.model.chunks, "devices": [str(d) for d in self.model.devices],
            "checkpoint": self.options.checkpoint, "untied": self.tied_names,
            "inplace_made_out_of_place": self.out_of_place,
        }

    def model_state_bytes(self) -> dict[str, int]:
        """The busiest device's share: one process drives every partition, but memory is per GPU."""
        shares = [model_state(partition, self.optimizer) for partition in self.model.partitions]
        return max(shares, key=lambda share: sum(share.values()))

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        first, last = self.model.devices[0], self.model.devices[-1]
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.ctx.workload.loss(self.model(inputs.to(first)), targets.to(last))
        loss.backward()
        pipeline.sum_tied_gradients(self.tied)
        self.clip_gradients(self.model.parameters())
        self.optimizer.step()
        return self.shard_loss(loss)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs.to(self.model.devices[0]))

    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            output = self.forward(inputs)
        return self.ctx.workload.metric_sums(output, targets.to(output.device))
