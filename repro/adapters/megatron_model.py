"""GPT-2 as megatron-core's GPTModel: its config, its layer spec, and the plain model's weights shard by shard.

Every framework trains the same network: GPTModel is configured as the workload's GPT-2 (learned
positions, pre-layer-norm blocks, tanh GELU, tied embeddings) and takes its weights, built by the
loop under the model seed (`megatron_weights`, then `copy_weights` on each rank).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from repro.workloads.gpt2_plan import GPT2Spec

LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which the plain GPT-2 uses


def padded_vocab(vocab: int, tp: int) -> int:
    """Vocabulary rows rounded up so they split evenly over tp ranks (GPT-2's 50257 is odd)."""
    return -(-vocab // tp) * tp


def transformer_engine_installed() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return HAVE_TE


def layer_spec_name(on_gpu: bool) -> str:
    """Transformer Engine's fused layers on GPUs where installed; megatron-core's local spec otherwise."""
    return "transformer-engine" if on_gpu and transformer_engine_installed() else "local"


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # megatron-core's own 16-bit modes (Float16Module)


def gpt_config(spec: GPT2Spec, tp: int, half: str | None, recompute: dict[str, Any]) -> Any:
    """megatron-core's TransformerConfig for the workload's GPT-2. CPU initialisation (public) builds
    the weights on any device, moved afterwards. They "initialise" with zeros_ because they are the
    plain model's, copied in; only that library path (tensor_parallel/layers.py,
    _initialize_affine_weight_cpu) tags the shards as tensor-parallel, which megatron-core's gradient
    clipping and this adapter's (param_is_not_tensor_parallel_duplicate) read. `recompute`: its recompute
    fields (repro.adapters.megatron_plan: `recompute_config`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec.n_layer, hidden_size=spec.d_model, num_attention_heads=spec.n_head,
        ffn_hidden_size=4 * spec.d_model, tensor_model_parallel_size=tp,
        hidden_dropout=spec.dropout, attention_dropout=spec.dropout, layernorm_epsilon=LAYER_NORM_EPS,
        activation_func=functools.partial(F.gelu, approximate="tanh"), bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, perform_initialization=True, init_method=nn.init.zeros_,
        output_layer_init_method=nn.init.zeros_, deterministic_mode=True,
        bf16=half == "bf16", fp16=half == "fp16", params_dtype=HALF.get(half, torch.float32),
        pipeline_dtype=HALF.get(half, torch.float32), **recompute,
    )


def build_gpt_model(spec: GPT2Spec, tp: int, layer_spec: str, half: str | None, recompute: dict[str, Any]) -> nn.Module:
    """megatron-core's GPTModel as the workload's GPT-2; `half`: megatron-core's bf16 or fp16
    mode, or None; `recompute`: gpt_config's."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_model import GPTModel

    layers = (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec() if layer_spec == "transformer-engine"
              else gpt_layer_specs.get_gpt_layer_local_spec())
    return GPTModel(
        config=gpt_config(spec, tp, half, recompute), transformer_layer_spec=layers,
        vocab_size=padded_vocab(spec.vocab_size, tp), max_sequence_length=spec.seq_len,
        position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True,
        parallel_output=True,
    )


def qkv_by_head(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """The plain model's fused [q; k; v] rows regrouped head by head ([q_h; k_h; v_h] for each head h),
    as megatron-core's SelfAttention splits linear_qkv (attention.py, get_query_key_value_tensors)."""
    return weight.reshape(3, n_head, -1, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)


def megatron_weights(plain: nn.Sequential, spec: GPT2Spec, tp: int) -> dict[str, torch.Tensor]:
    """The plain GPT-2's weights, whole, under the names of GPTModel's local spec."""
    wte = torch.zeros(padded_vocab(spec.vocab_size, tp), spec.d_model)
    wte[: spec.vocab_size] = plain[0].wte.weight.detach()  # padding rows: masked out of the logits
    weights = {"embedding.word_embeddings.weight": wte, "embedding.position_embeddings.weight": plain[0].wpe.weight}
    pieces = {"input_layernorm": "ln_1", "self_attention.linear_qkv": "attn.c_attn",
              "self_attention.linear_proj": "attn.c_proj", "pre_mlp_layernorm": "ln_2",
              "mlp.linear_fc1": "mlp.c_fc", "mlp.linear_fc2": "mlp.c_proj"}
    for index, block in enumerate(plain[1:-1]):
        for ours, theirs in pieces.items():
            for kind in ("weight", "bias"):
                value = block.get_parameter(f"{theirs}.{kind}")
                if ours.endswith("linear_qkv"):
                    value = qkv_by_head(value, spec.n_head)
                weights[f"decoder.layers.{index}.{ours}.{kind}"] = value
    for kind in ("weight", "bias"):
        weights[f"decoder.final_layernorm.{kind}"] = plain[-1].ln_f.get_parameter(kind)
    return {name: value.detach() for name, value in weights.items()}


# Transformer Engine's spec fuses each layer norm into the linear layer after it.
TRANSFORMER_ENGINE_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def copy_weights(model: nn.Module, weights: dict[str, torch.Tensor], tp_rank: int, tp: int) -> None:
    """Each of `model`'s parameters takes its (shard of its) plain weight; every one must have one."""
    for name, param in model.named_parameters():
        source = next((name.replace(te, local) for te, local in TRANSFORMER_ENGINE_NAMES.items() if name.endswith(te)),
                      name)
        if source not in weights:
            raise RuntimeError(f"GPTModel's parameter {name} has no counterpart in the workload's GPT-2")
        value = weights[source]
        if param.shape != value.shape:  # this rank's shard: 1/tp of the one dimension that differs
            split = next(d for d, (ours, whole) in enumerate(zip(param.shape, value.shape)) if ours * tp == whole)
            value = value.chunk(tp, dim=split)[tp_rank]
        with torch.no_grad():
            param.copy_(value)
