"""Megatron (megatron-core): intra-layer (tensor) parallelism, data parallelism over the other ranks.

World = tp x dp. megatron-core's parallel_state makes the groups, and the network is megatron-core's
own `GPTModel`: its embedding and output projection split by vocabulary rows, attention by heads
and the MLP by its hidden units (ColumnParallelLinear then RowParallelLinear, one all-reduce each
in forward and backward). tp=1 is the paper's Megatron-data, tp=world its Megatron-intra, anything
between the hybrid it recommends (tensor parallel within a node, data parallel across nodes).

Every framework trains the same network: GPTModel is configured as the workload's GPT-2 (learned
positions, pre-layer-norm blocks, tanh GELU, tied embeddings) and takes its weights, built by the
loop under the model seed, shard by shard (repro/adapters/megatron_model.py).

Two paths, recorded on the run (`pieces`, MLflow's `effective.*`):
- GPUs, as Megatron trains (after megatron-core's own examples/run_simple_mcore_train_loop.py in
  NVIDIA/Megatron-LM: GPTModel, then DistributedDataParallel, backward, finalize_model_grads, step):
  Transformer Engine's layer spec where it is installed (the local spec otherwise), megatron-core's
  DistributedDataParallel (contiguous gradient buffers, gradient all-reduce overlapped with the
  backward pass) and `get_megatron_optimizer`, optionally the distributed optimizer; bf16 and fp16 through
  megatron-core's Float16Module and its fp32 main parameters, fp16 with the optimizer's dynamic loss scale
  (optimizer/grad_scaler.py, DynamicGradScaler: get_megatron_optimizer makes one for fp16 without a
  fixed loss_scale; its found-inf flag is all-reduced over the model-parallel group, optimizer.py
  `_unscale_main_grads_and_check_for_nan`) and the loss scaled by `optimizer.scale_loss`, as Megatron's
  schedules scale it (`config.grad_scale_func`). Not yet run on a GPU.
- CPU: the local layer spec with the adaptations of repro/adapters/megatron_cpu.py (megatron-core
  hard-codes CUDA there). megatron-core's DistributedDataParallel and optimizer allocate on CUDA
  unconditionally (distributed/param_and_grad_buffer.py, optimizer/optimizer.py), so this adapter
  averages gradients over the dp group itself (one flattened all-reduce per step) and steps torch's
  optimizer, which is what megatron-core falls back to without Apex or Transformer Engine. fp32 only
  (MegatronPlan.check_device says why).
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from repro import seeding
from repro.adapters.base import Adapter
from repro.adapters.megatron_model import (
    build_gpt_model, copy_weights, layer_spec_name, megatron_weights, padded_vocab,
)
from repro.adapters.megatron_plan import MegatronPlan
from repro.checkpoint import atomic_torch_save
from repro.metrics import tensor_bytes
from repro.optim import make_optimizer


class RngStream:
    """A private random stream, entered around the code that draws from it.

    Dropout on activations that tensor-parallel peers replicate must draw the same mask on every
    peer, or the replicas drift apart; dropout inside the parallel region (attention probabilities
    of this rank's heads) must draw its own. Megatron keeps such streams in its CUDA RNG tracker,
    which needs CUDA; this is the same idea on any device.
    """

    def __init__(self, seed: int, device: torch.device):
        self.cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=self.cuda):
            torch.manual_seed(seed)
            self.state = self._capture()

    def _capture(self) -> tuple[torch.Tensor, ...]:
        return (torch.get_rng_state(), *(torch.cuda.get_rng_state(i) for i in self.cuda))

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        with torch.random.fork_rng(devices=self.cuda):
            torch.set_rng_state(self.state[0])
            for index, state in zip(self.cuda, self.state[1:]):
                torch.cuda.set_rng_state(state, index)
            yield
            self.state = self._capture()


# -- the adapter -------------------------------------------------------------------------------


class MegatronAdapter(MegatronPlan, Adapter):
    def setup(self, model: nn.Sequential) -> None:
        from megatron.core import parallel_state

        ctx, tp = self.ctx, self.options.tp
        self.on_gpu = ctx.device.type == "cuda"
        self.check_device(ctx.recipe, ctx.recipe.source, ctx.device.type)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, distributed_timeout_minutes=math.ceil(ctx.recipe.run.timeout_s / 60),
        )
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp = parallel_state.get_data_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        if not self.on_gpu:
            from repro.adapters import megatron_cpu

            megatron_cpu.install()
        self.dropout_streams()

        spec, self.layer_spec = ctx.workload.spec, layer_spec_name(self.on_gpu)
        precision = ctx.recipe.train.precision
        self.megatron_half = precision if self.on_gpu and precision in ("bf16", "fp16") else None
        gpt = build_gpt_model(spec, tp, self.layer_spec, self.megatron_half, self.recompute_config(ctx.recipe))
        copy_weights(gpt, megatron_weights(model, spec, tp), tp_rank, tp)
        self.gpt = gpt.to(ctx.device)
        padding = torch.arange(padded_vocab(spec.vocab_size, tp)).chunk(tp)[tp_rank] >= spec.vocab_size
        self.padding, self.padded = padding.to(ctx.device), bool(padding.any())  # padding rows are not words
        self.positions = torch.arange(spec.seq_len, device=ctx.device)
        self.mask = None if self.on_gpu else megatron_cpu.causal_mask(spec.seq_len)
        if self.on_gpu:
            self.model, self.optimizer = self.megatron_training(self.gpt)
        else:
            self.model, self.optimizer = self.gpt, make_optimizer(ctx.recipe.optimizer(), self.gpt.parameters())

    def dropout_streams(self) -> None:
        """tp peers share their dp rank's stream (as DDP rank dp_rank would): dropout on replicated
        activations (embedding, residual branches) draws the same mask on every peer. Attention
        dropout of this rank's heads draws from megatron-core's tracker, a stream per rank (on the
        CPU, megatron_cpu's tracker, installed before)."""
        from megatron.core.tensor_parallel import random as mcore_random

        ctx = self.ctx
        if self.on_gpu:
            mcore_random.initialize_rng_tracker(force_reset=True)
        ctx.seeds["shared_dropout"] = seeding.derive(ctx.recipe.seed, "rank_stream", self.dp_rank)
        ctx.seeds["tp_local_dropout"] = seeding.derive(ctx.recipe.seed, "tp_local_dropout", ctx.rank)
        self.shared_rng = RngStream(ctx.seeds["shared_dropout"], ctx.device)
        self.tracker = mcore_random.get_cuda_rng_tracker()
        self.tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, ctx.seeds["tp_local_dropout"])

    def megatron_training(self, gpt: nn.Module) -> tuple[nn.Module, Any]:
        """megatron-core's DistributedDataParallel and optimizer around GPTModel, as its example wires them."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        config, wanted = gpt.config, self.ctx.recipe.optimizer()
        module = Float16Module(config, gpt) if self.megatron_half else gpt
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=True,
            use_distributed_optimizer=self.options.distributed_optimizer,
        )
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
        config.no_sync_func = model.no_sync  # the schedule reduces the gradients with the last micro-batch only
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="sgd" if wanted.name == "sgd" else "adam", lr=wanted.lr, weight_decay=wanted.weight_decay,
            decoupled_weight_decay=wanted.name == "adamw", adam_beta1=wanted.betas[0], adam_beta2=wanted.betas[1],
            adam_eps=wanted.eps, sgd_momentum=wanted.momentum, bf16=self.megatron_half == "bf16",
            fp16=self.megatron_half == "fp16",
            params_dtype=config.params_dtype, use_distributed_optimizer=self.options.distributed_optimizer,
            clip_grad=self.ctx.recipe.train.grad_clip or 0.0,
        ), [model])
        # the schedule's backward scales each micro-batch's loss by it, as Megatron-LM's training.py wires it
        # (schedules.py, backward_step): fp16, the dynamic loss scale; otherwise 1
        config.grad_scale_func = optimizer.scale_loss
        return model, optimizer

    def pieces(self) -> dict[str, str]:
        """What trains this run, piece by piece (MLflow's effective.*, a column of the results table)."""
        if not self.on_gpu:
            return {"model_impl": "megatron-core GPTModel", "layer_spec": self.layer_spec,
                    "dp_impl": "repro all-reduce (megatron-core DDP needs CUDA)",
                    "optimizer_impl": f"torch {type(self.optimizer).__name__} (megatron-core's needs CUDA)"}
        sharded = " distributed" if self.options.distributed_optimizer else ""
        return {"model_impl": "megatron-core GPTModel", "layer_spec": self.layer_spec,
                "dp_impl": "megatron-core DistributedDataParallel (overlap_grad_reduce)",
                "optimizer_impl": f"megatron-core {type(self.optimizer).__name__}{sharded}"}

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary-parallel logits, [batch, seq, padded vocab / tp]; padding rows -inf."""
        positions = self.positions[: inputs.shape[1]].expand_as(inputs)
        mask = None if self.mask is None else self.mask[..., : inputs.shape[1], : inputs.shape[1]]
        logits = self.model(inputs, positions, mask)
        return logits.masked_fill(self.padding, float("-inf")) if self.padded else logits

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward through megatron-core's schedule (pipeline_parallel/schedules.py,
        forward_backward_no_pipelining: num_microbatches passes, the loss of each divided by their number,
        gradient sync held back by `config.no_sync_func` but for the last), then the gradients' reduction
        and the optimizer's step."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
        if self.on_gpu:
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        micro = [(part, target) for part, target, _ in self.split_micro_batches(inputs, targets)]
        with self.schedule_devices():
            losses = get_forward_backward_func()(
                forward_step_func=self.forward_step, data_iterator=iter(micro), model=self.model,
                num_microbatches=len(micro), seq_length=inputs.shape[1], micro_batch_size=micro[0][0].shape[0])
        loss = torch.stack([reduced["loss"] for reduced in losses]).mean()
        if self.on_gpu:
            from megatron.core.distributed.finalize_model_grads import finalize_model_grads

            finalize_model_grads([self.model])  # waits for the overlapped all-reduce; clipping is the optimizer's
            self.optimizer.step()  # fp16: skipped, on every rank, where a gradient overflowed
        else:
            self.average_gradients()
            self.clip_gradients(self.model.parameters())
            self.optimizer.step()
        return self.shard_loss(loss)

    def forward_step(self, micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]], model: nn.Module) -> tuple[torch.Tensor, Any]:
        """megatron-core's forward_step_func: the next micro-batch's mean loss, and the loss function the
        schedule applies to it before dividing it by num_microbatches in place (a copy is what it reports)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        inputs, targets = next(micro_batches)
        # megatron-core's bf16 and fp16 are Float16Module's 16-bit weights (fp32 main copies in the optimizer), not autocast
        autocast = contextlib.nullcontext() if self.megatron_half else self.autocast()
        with self.shared_rng.fork(), autocast:
            loss = vocab_parallel_cross_entropy(self.logits(inputs).float(), targets).mean()
        return loss, lambda output: (output, {"loss": output.detach().clone()})

    def schedule_devices(self) -> contextlib.AbstractContextManager:
        """On the CPU, megatron_cpu's redirection of the schedule's CUDA allocations."""
        if self.on_gpu:
            return contextlib.nullcontext()
        from repro.adapters import megatron_cpu

        return megatron_cpu.CudaAllocationsOnCpu()

    def average_gradients(self) -> None:
        """Mean of the dp replicas' gradients: one all-reduce of all gradients, flattened."""
        if self.dp == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp
        for grad, averaged in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(averaged.view_as(grad))

    def clip_gradients(self, parameters: Any) -> None:
        """Clip by the norm of the whole model's gradient: shards summed over the tp group, replicas once."""
        limit = self.ctx.recipe.train.grad_clip
        if not limit:
            return
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        grads = [p.grad for p in parameters if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
        squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
        norm = float(self.all_reduce(squares, self.tp_group)) ** 0.5
        scale = limit / (norm + 1e-6)
        if scale < 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits, gathered from the tp group as the plain model returns them (no autograd).

        megatron-core's gather_from_tensor_model_parallel_region allocates on CUDA, hence all_gather here.
        """
        with torch.no_grad(), self.shared_rng.fork():
            local = self.logits(inputs).contiguous()
        parts = [local]
        if self.options.tp > 1:
            parts = [torch.empty_like(local) for _ in range(self.options.tp)]
            dist.all_gather(parts, local, group=self.tp_group)
        return torch.cat(parts, dim=-1)[..., : self.ctx.workload.spec.vocab_size]

    def data_shard(self) -> tuple[int, int]:
        """tp peers consume the same samples: shards are per dp rank."""
        return self.dp_rank, self.dp

    @property
    def data_group(self) -> Any:
        return self.dp_group

    def model_state_bytes(self) -> dict[str, int]:
        """On the CPU path, the base count. On GPUs, megatron-core's DDP keeps gradients in its contiguous
        buffers (not param.grad) and its optimizer its own fp32 copies and moments (not yet run on a GPU)."""
        if not self.on_gpu:
            return super().model_state_bytes()
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        held = [t for o in optimizers for state in o.optimizer.state.values() for t in state.values()]
        if self.megatron_half or self.options.distributed_optimizer:  # fp32 main parameters beside the model's
            held += [p for o in optimizers for group in o.optimizer.param_groups for p in group["params"]]
        return {"parameters": tensor_bytes(self.gpt.parameters()),
                "gradients": tensor_bytes(b.grad_data for b in self.model.buffers),
                "optimizer": tensor_bytes(t for t in held if isinstance(t, torch.Tensor))}

    def state_dict(self) -> dict[str, Any]:
        """This rank's tp shard and its optimizer state, and the dropout streams that the loop's saved
        default generators do not cover: the shared one (RngStream) and megatron-core's tracker."""
        streams = {"shared_rng": self.shared_rng.state, "tracker": self.tracker.get_states()}
        return {**super().state_dict(), **streams}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.shared_rng.state = tuple(state["shared_rng"])
        self.tracker.set_states(dict(state["tracker"]))

    def save_checkpoint(self, folder: Path) -> None:
        """One file per rank: tp peers hold different shards (and every rank its own local stream)."""
        if self.on_gpu and self.options.distributed_optimizer:
            raise RuntimeError("megatron: checkpointing the distributed optimizer (its sharded state needs "
                               "megatron-core's dist_checkpointing) is not built; set megatron.distributed_optimizer=false")
        atomic_torch_save(self.state_dict(), self.checkpoint_file(folder))

    def load_checkpoint(self, folder: Path) -> None:
        # on the CPU: RNG states must stay CPU byte tensors; weights and optimizer state move on loading
        self.load_state_dict(torch.load(self.checkpoint_file(folder), map_location="cpu"))

    def checkpoint_file(self, folder: Path) -> Path:
        return folder / f"megatron-rank{self.ctx.rank}.pt"

    def teardown(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
