"""The kit's paper-scale memory figures for GPT-2-medium beside two independent estimators (docs/memory.md,
"An independent estimate"): llm-analysis (PyPI `llm-analysis`, Korthikanti et al.'s activation count) and
DeepSpeed's model-state estimators (`estimate_zero2_model_states_mem_needs`, `..._zero3_...`).

Neither is a dependency of the kit: llm-analysis runs in a separate environment (`--peer-python`, made as
`python3 -m venv /work/scratch/peer && /work/scratch/peer/bin/pip install llm-analysis`), called once per
row through a subprocess; DeepSpeed's estimators are imported from the environment running this script
(the kit's, where deepspeed is installed). Each row is a cell of the recipe (configs/gpt2-paper.yaml) with
its framework's own memory settings (train_by_framework), per GPU, GiB:

    python bench/memory_peer.py [--peer-python PATH] [--gpus N]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass

from repro.model import costs
from repro.model.predict import recipe_cell
from repro.shapes import parameters

GIB = 2**30

# llm-analysis's training analysis of one row, in its own environment; prints its summary's memory figures
# (its training analysis refuses a micro-batch over the GPU's memory: the figures are wanted whatever they
# are, so a copy of its V100 with room for any, named "unbounded"; memory figures do not depend on the GPU)
PEER = """
import dataclasses, json, sys
from llm_analysis import config
from llm_analysis.analysis import train
config.gpu_configs["unbounded"] = dataclasses.replace(config.gpu_configs["v100-sxm-16gb"], mem_per_GPU_in_GB=1e6)
args = json.loads(sys.argv[1])
summary = train(model_name="gpt2-medium", gpu_name="unbounded", dtype_name="w16a16e16", log_level="ERROR",
                flash_attn=False, softmax_dropout=True, num_gpus_per_node=8, **args)
print(json.dumps({key: value for key, value in summary.items() if "memory" in key}))
"""


@dataclass(frozen=True)
class Row:
    label: str
    framework: str
    gpus: int
    sets: tuple[str, ...] = ()

    @property
    def stage(self) -> int:
        """The ZeRO stage in llm-analysis's and DeepSpeed's terms (0: plain data parallelism)."""
        return next((int(text.split("=")[1]) for text in self.sets if text.startswith("zero.stage=")),
                    2 if self.framework == "zero" else 0)

    @property
    def tp(self) -> int:
        return next((int(text.split("=")[1]) for text in self.sets if text.startswith("megatron.tp=")), 1)


def rows(gpus: int) -> list[Row]:
    """DDP and ZeRO-1/2/3 at `gpus`, Megatron-intra at tp=4 and tp=8 (one tp group, as the matrix runs it)."""
    return [Row("ddp", "ddp", gpus), *(Row(f"zero-{s}", "zero", gpus, (f"zero.stage={s}",)) for s in (1, 2, 3)),
            *(Row(f"megatron tp={tp}", "megatron", tp, (f"megatron.tp={tp}",)) for tp in (4, 8))]


# The recipe's train.precision auto as it trains on ThetaGPU's A100: bf16 under autocast, fp32 weights (on the
# V100 ZeRO trains in DeepSpeed's fp16 mode, 16-bit weights with an fp32 master partition, as the peers assume)
PEER_GPU = "A100"


def kit(row: Row) -> tuple[costs.Cell, costs.Prediction]:
    cell = recipe_cell("gpt2", row.framework, row.gpus, "paper", row.sets, gpu=PEER_GPU)
    return cell, costs.predict(cell)


def peer_args(row: Row, cell: costs.Cell) -> dict[str, object]:
    """llm-analysis's training arguments for the kit's cell: its micro-batch is the tp group's sequences
    per pass (the paper's rule: batch_per_gpu x tp for the group), accumulated over the kit's passes."""
    micro = cell.micro_batch or cell.batch_per_gpu
    return {"batch_size_per_gpu": micro * row.tp, "gradient_accumulation_steps": cell.batch_per_gpu // micro,
            "seq_len": cell.shape.seq_len, "activation_recomputation": 2 if cell.recomputed else 0,
            "ds_zero": row.stage, "tp_size": row.tp, "sp_size": 1, "total_num_gpus": row.gpus}  # no sequence parallelism


def llm_analysis(python: str, args: dict[str, object]) -> dict[str, float] | None:
    done = subprocess.run([python, "-c", PEER, json.dumps(args)], capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None


def deepspeed_state(row: Row, cell: costs.Cell) -> float | None:
    """DeepSpeed's estimate of model state per GPU, GPU side, no offload (None: not a ZeRO row, or no deepspeed).
    stage_1_and_2.py, estimate_zero2_model_states_mem_needs: 2 Psi + 18 Psi / N (its buffer factor scales
    the CPU figure only); stage3.py, estimate_zero3_model_states_mem_needs: 4 x the largest layer + 18 Psi / N."""
    if row.framework != "zero":
        return None
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except ImportError:
        return None
    psi = parameters(cell.shape)
    if row.stage == 3:
        largest = cell.shape.vocab * cell.shape.d_model  # the tied token embedding
        return estimate_zero3_model_states_mem_needs(psi, largest, row.gpus, 1, cpu_offload=False)[1]
    return estimate_zero2_model_states_mem_needs(psi, row.gpus, 1, cpu_offload=False)[1]


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-python", default="/work/scratch/peer/bin/python", help="python with llm-analysis")
    parser.add_argument("--gpus", type=int, default=64, help="GPUs of the data-parallel rows")
    options = parser.parse_args()
    print("GPT-2-medium, paper recipe with each framework's own memory settings, per GPU, GiB")
    print(f"{'row':<16}{'gpus':>5}  {'kit: params grads optim state activ peak':<44}"
          f"{'llm-analysis: state activ peak':<32}{'deepspeed: state':>17}  settings")
    for row in rows(options.gpus):
        cell, mine = kit(row)
        peer = llm_analysis(options.peer_python, peer_args(row, cell)) or {}
        state = peer.get("(weight+op_state+grad)_memory_per_gpu")
        kit_text = " ".join(f"{gib(v):>6}" for v in (mine.parameters, mine.gradients, mine.optimizer, mine.model_state,
                                                      mine.activations, mine.estimated_peak))
        peer_text = " ".join(f"{gib(v):>6}" for v in (state, peer.get("activation_memory_per_gpu"),
                                                      peer.get("(weight+op_state+grad+act)_memory_per_gpu")))
        micro = cell.micro_batch or cell.batch_per_gpu
        print(f"{row.label:<16}{row.gpus:>5}  {kit_text:<44}{peer_text:<32}{gib(deepspeed_state(row, cell)):>17}  "
              f"{'recompute' if cell.recomputed else 'no recompute'}, micro {micro} x {cell.batch_per_gpu // micro}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
