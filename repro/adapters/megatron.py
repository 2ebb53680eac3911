"""Megatron (megatron-core): intra-layer (tensor) parallelism, data parallelism over the other ranks.

World = tp x dp. megatron-core's parallel_state makes the groups; each tp group splits every layer
of GPT-2 the Megatron way: the embedding and output projection by vocabulary rows
(VocabParallelEmbedding, vocab-parallel cross entropy), attention by heads and the MLP by its
hidden units (ColumnParallelLinear then RowParallelLinear, one all-reduce each in forward and
backward). tp=1 is the paper's Megatron-data, tp=world its Megatron-intra, anything between the
hybrid it recommends (tensor parallel within a node, data parallel across nodes).

The network is the workload's plain GPT-2, built by the loop under the model seed: its weights are
copied, shard by shard, into megatron-core's layers, so every framework trains the same network.
Megatron's full GPTModel calls CUDA inside attention, so the blocks are assembled here from the
tensor-parallel layers. megatron-core's DistributedDataParallel and optimizer wrappers allocate
on CUDA unconditionally, so this adapter averages gradients over the dp group itself (one
flattened all-reduce per step) and steps the kit's optimizer (torch AdamW or SGD, which is what
megatron-core falls back to without Apex or Transformer Engine).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from repro import seeding
from repro.adapters.base import Adapter
from repro.checkpoint import atomic_torch_save
from repro.optim import make_optimizer
from repro.recipe import FrameworkOptions, Recipe
from repro.schema import RecipeError
from repro.workloads.gpt2 import GPT2Spec

MEGATRON_OPTIMIZERS = ("adam", "adamw", "sgd")  # what megatron-core's get_megatron_optimizer offers


@dataclass
class MegatronOptions(FrameworkOptions):
    tp: int = 1  # tensor-parallel size: ranks that split each layer; dp = gpus / tp


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


# -- GPT-2 from megatron-core's tensor-parallel layers ------------------------------------------
# Each module mirrors its plain counterpart in repro/workloads/gpt2.py and takes its weights.


def padded_vocab(vocab: int, tp: int) -> int:
    """Vocabulary rows rounded up so they split evenly over tp ranks (GPT-2's 50257 is odd)."""
    return -(-vocab // tp) * tp


def copy_shard(target: nn.Parameter, full: torch.Tensor, dim: int, rank: int, tp: int) -> None:
    with torch.no_grad():
        target.copy_(full.chunk(tp, dim=dim)[rank])


class ParallelContext:
    """What every parallel module needs: megatron-core's layer config, tp rank and size."""

    def __init__(self, tp: int, rank: int):
        from megatron.core import ModelParallelConfig

        self.tp, self.rank = tp, rank
        # CPU initialisation works on any device (the model moves afterwards). The layers "initialise"
        # with zeros_ because their weights are the plain model's, copied in; that library path also
        # tags the shards as tensor-parallel, which megatron-core's helpers read.
        self.config = ModelParallelConfig(
            tensor_model_parallel_size=tp, use_cpu_initialization=True, deterministic_mode=True
        )

    def column(self, plain: nn.Linear, rows: torch.Tensor | None = None) -> nn.Module:
        """ColumnParallelLinear holding `rows` (default: this rank's block) of `plain`'s outputs."""
        from megatron.core.tensor_parallel import ColumnParallelLinear

        layer = ColumnParallelLinear(
            plain.in_features, plain.out_features, config=self.config, init_method=nn.init.zeros_,
            bias=True, gather_output=False,
        )
        rows = rows if rows is not None else torch.arange(plain.out_features).chunk(self.tp)[self.rank]
        with torch.no_grad():
            layer.weight.copy_(plain.weight[rows])
            layer.bias.copy_(plain.bias[rows])
        return layer

    def row(self, plain: nn.Linear) -> nn.Module:
        """RowParallelLinear holding this rank's block of `plain`'s inputs (bias added after the all-reduce)."""
        from megatron.core.tensor_parallel import RowParallelLinear

        layer = RowParallelLinear(
            plain.in_features, plain.out_features, config=self.config, init_method=nn.init.zeros_,
            bias=True, input_is_parallel=True, skip_bias_add=False,
        )
        copy_shard(layer.weight, plain.weight, 1, self.rank, self.tp)
        with torch.no_grad():
            layer.bias.copy_(plain.bias)
        return layer


class ParallelEmbedding(nn.Module):
    def __init__(self, plain: nn.Module, spec: GPT2Spec, par: ParallelContext):
        from megatron.core.tensor_parallel import VocabParallelEmbedding

        super().__init__()
        rows = padded_vocab(spec.vocab_size, par.tp)
        self.wte = VocabParallelEmbedding(rows, spec.d_model, init_method=nn.init.zeros_, config=par.config)
        padded = torch.zeros(rows, spec.d_model)
        padded[: spec.vocab_size] = plain.wte.weight.detach()
        copy_shard(self.wte.weight, padded, 0, par.rank, par.tp)
        self.wpe, self.drop = plain.wpe, plain.drop  # replicated on every tp peer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(positions))


class ParallelAttention(nn.Module):
    """This rank's heads: q, k and v rows of those heads (column-parallel), output rows (row-parallel)."""

    def __init__(self, plain: nn.Module, spec: GPT2Spec, par: ParallelContext, local: RngStream):
        super().__init__()
        width = spec.d_model
        self.n_head, self.width = spec.n_head // par.tp, width // par.tp
        mine = torch.arange(width).chunk(par.tp)[par.rank]
        self.c_attn = par.column(plain.c_attn, torch.cat([mine, mine + width, mine + 2 * width]))
        self.c_proj = par.row(plain.c_proj)
        self.dropout, self.resid_drop, self.local = plain.dropout, plain.resid_drop, local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.c_attn(x)[0].split(self.width, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, self.width // self.n_head).transpose(1, 2) for t in (q, k, v))
        with self.local.fork():
            dropout = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(batch, seq, self.width))[0])


class ParallelMLP(nn.Module):
    def __init__(self, plain: nn.Module, par: ParallelContext):
        super().__init__()
        self.c_fc, self.c_proj, self.drop = par.column(plain.c_fc), par.row(plain.c_proj), plain.drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x)[0], approximate="tanh"))[0])


class ParallelBlock(nn.Module):
    def __init__(self, plain: nn.Module, spec: GPT2Spec, par: ParallelContext, local: RngStream):
        super().__init__()
        self.ln_1, self.ln_2 = plain.ln_1, plain.ln_2
        self.attn, self.mlp = ParallelAttention(plain.attn, spec, par, local), ParallelMLP(plain.mlp, par)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ParallelHead(nn.Module):
    """Final layer norm and the output projection onto this rank's vocabulary rows (the embedding's)."""

    def __init__(self, plain: nn.Module, embedding: ParallelEmbedding, spec: GPT2Spec, par: ParallelContext):
        from megatron.core.tensor_parallel import ColumnParallelLinear

        super().__init__()
        self.ln_f, self.weight = plain.ln_f, embedding.wte.weight
        rows = padded_vocab(spec.vocab_size, par.tp)
        self.project = ColumnParallelLinear(
            spec.d_model, rows, config=par.config, init_method=nn.init.zeros_, bias=False,
            gather_output=False, skip_weight_param_allocation=True,
        )
        # Padding rows are not words: -inf logits give them no probability and no gradient.
        local_rows = torch.arange(rows).chunk(par.tp)[par.rank]
        self.register_buffer("padding", local_rows >= spec.vocab_size, persistent=False)
        self.padded = bool(self.padding.any())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.project(self.ln_f(x), weight=self.weight)[0]
        return logits.masked_fill(self.padding, float("-inf")) if self.padded else logits


def parallel_gpt2(plain: nn.Sequential, spec: GPT2Spec, par: ParallelContext, local: RngStream) -> nn.Sequential:
    """The workload's GPT-2 with its weights sharded into megatron-core layers; outputs vocab-parallel logits."""
    embedding = ParallelEmbedding(plain[0], spec, par)
    blocks = [ParallelBlock(block, spec, par, local) for block in plain[1:-1]]
    return nn.Sequential(embedding, *blocks, ParallelHead(plain[-1], embedding, spec, par))


# -- the adapter -------------------------------------------------------------------------------


class MegatronAdapter(Adapter):
    Options = MegatronOptions

    workloads = ("gpt2",)
    not_applicable_because = "Megatron's intra-layer scheme targets transformers"

    @classmethod
    def check(cls, recipe: Recipe, source: str) -> None:
        tp, gpus, spec = recipe.options("megatron").tp, recipe.run.gpus, recipe.model
        if tp < 1:
            raise RecipeError(source, "megatron.tp", f"must be at least 1, got {tp}")
        if gpus % tp:
            raise RecipeError(
                source, "megatron.tp", f"gpus ({gpus}) must be tp ({tp}) x dp: {gpus} % {tp} = {gpus % tp}"
            )
        if spec.n_head % tp:
            raise RecipeError(
                source, "megatron.tp", f"model.n_head ({spec.n_head}) must split over tp ({tp}): "
                f"{spec.n_head} % {tp} = {spec.n_head % tp}",
            )
        if recipe.optimizer().name not in MEGATRON_OPTIMIZERS:
            raise RecipeError(
                source, "megatron.optimizer",
                f"megatron-core's optimizers are {', '.join(MEGATRON_OPTIMIZERS)}, not {recipe.optimizer().name} "
                "(LAMB's per-tensor trust ratio would be taken per shard); set megatron.optimizer",
            )
        if recipe.train.precision == "fp16":
            raise RecipeError(
                source, "train.precision",
                "fp16 needs a loss scale agreed over the tp group (megatron-core's Float16Optimizer, CUDA only); "
                "use bf16 or fp32",
            )

    @classmethod
    def variant(cls, recipe: Recipe) -> str:
        """The paper's name of this run's scheme: megatron-data (tp=1), -intra (tp=gpus) or -hybrid."""
        tp = recipe.options("megatron").tp
        if tp == 1:
            return "megatron-data"
        return "megatron-intra" if tp == recipe.run.gpus else "megatron-hybrid"

    def setup(self, model: nn.Sequential) -> None:
        from megatron.core import parallel_state

        ctx = self.ctx
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.options.tp,
            distributed_timeout_minutes=math.ceil(ctx.recipe.run.timeout_s / 60),
        )
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp = parallel_state.get_data_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # tp peers share their dp rank's stream (as DDP rank dp_rank would); attention dropout is per rank.
        ctx.seeds["shared_dropout"] = seeding.derive(ctx.recipe.seed, "rank_stream", self.dp_rank)
        ctx.seeds["tp_local_dropout"] = seeding.derive(ctx.recipe.seed, "tp_local_dropout", ctx.rank)
        self.shared_rng = RngStream(ctx.seeds["shared_dropout"], ctx.device)
        self.local_rng = RngStream(ctx.seeds["tp_local_dropout"], ctx.device)
        par = ParallelContext(self.options.tp, tp_rank)
        self.model = parallel_gpt2(model, ctx.workload.spec, par, self.local_rng).to(ctx.device)
        self.optimizer = make_optimizer(ctx.recipe.optimizer(), self.model.parameters())

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
        self.optimizer.zero_grad(set_to_none=True)
        with self.shared_rng.fork(), self.autocast():
            loss = vocab_parallel_cross_entropy(self.model(inputs).float(), targets).mean()
        loss.backward()
        self.average_gradients()
        self.clip_gradients(self.model.parameters())
        self.optimizer.step()
        return self.shard_loss(loss)

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
            local = self.model(inputs).contiguous()
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

    def state_dict(self) -> dict[str, Any]:
        """This rank's tp shard and its optimizer state, and the dropout streams that the loop's saved
        default generators do not cover (they live outside them, see RngStream)."""
        return {**super().state_dict(), "shared_rng": self.shared_rng.state, "local_rng": self.local_rng.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.shared_rng.state, self.local_rng.state = tuple(state["shared_rng"]), tuple(state["local_rng"])

    def save_checkpoint(self, folder: Path) -> None:
        """One file per rank: tp peers hold different shards (and every rank its own local stream)."""
        atomic_torch_save(self.state_dict(), self.checkpoint_file(folder))

    def load_checkpoint(self, folder: Path) -> None:
        # on the CPU: RNG states must stay CPU byte tensors; weights and optimizer state move on loading
        self.load_state_dict(torch.load(self.checkpoint_file(folder), map_location="cpu"))

    def checkpoint_file(self, folder: Path) -> Path:
        return folder / f"megatron-rank{self.ctx.rank}.pt"

    def teardown(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
