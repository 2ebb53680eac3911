"""The kit's predicted step time for GPT-2 medium (the paper recipe, DDP on 1 GPU: no communication) on an
A100 and a V100, beside one independent estimator from PyPI, llm-analysis (github.com/cli99/llm-analysis):
what docs/time.md, "A peer", explains line by line. llm-analysis is not a dependency of the kit: it runs
from its own virtual environment, as a subprocess.

    python3 -m venv /work/scratch/timepeer && /work/scratch/timepeer/bin/pip install llm-analysis
    python bench/time_peer.py --peer-python /work/scratch/timepeer/bin/python
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess

from repro.model import platforms, time
from repro.model.flops import step_flops
from repro.model.predict import recipe_cell

# each kit profile against the llm-analysis GPU of the same part (llm_analysis/gpu_configs/*.json)
GPUS = {"thetagpu": "a100-sxm-40gb", "lassen": "v100-sxm-16gb"}
PEER = """
import json, sys
from llm_analysis.analysis import train
out = {}
for gpu in sys.argv[1].split(","):
    # micro-batches of 8 (its memory check refuses 32 at once on its V100 entry); its latency is linear in them
    s = train(model_name="gpt2-medium", gpu_name=gpu, dtype_name="w16a16e16", log_level="ERROR",
              batch_size_per_gpu=8, gradient_accumulation_steps=int(sys.argv[2]) // 8, seq_len=int(sys.argv[3]), total_num_gpus=1,
              flops_efficiency=float(sys.argv[4]), hbm_memory_efficiency=float(sys.argv[5]), flash_attn=True)
    out[gpu] = {k: s[k] for k in ("latency_per_iter", "num_flops_total_per_micro_batch", "latency_fwd",
                                  "latency_fwd_attn", "latency_fwd_mlp", "latency_fwd_layernorm",
                                  "latency_fwd_output_embedding_loss")}
print(json.dumps(out))
"""


def kit(profile: platforms.Platform, precision: str) -> dict[str, float]:
    """The kit's step time of the GPT-2 paper recipe's DDP cell on 1 GPU at `precision`: total, matrix
    work alone (memory made free), and the FLOPs it counts."""
    cell = dataclasses.replace(recipe_cell("gpt2", "ddp", 1), precision=precision)
    free_memory = dataclasses.replace(profile, memory=platforms.Memory(bandwidth=float("inf")))
    flops = step_flops(cell)
    return {"step_s": time.step_time(cell, profile).total_s, "matrix_s": time.step_time(cell, free_memory).total_s,
            "flops": flops.counted, "batch": cell.batch_per_gpu, "seq_len": cell.shape.seq_len}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", required=True, help="the python of a virtual environment with llm-analysis")
    args = parser.parse_args()
    rows = {}
    for name, gpu in GPUS.items():
        profile = platforms.load(name)
        for precision in ("bf16", "fp16"):
            rows[(name, precision)] = kit(profile, precision)
    sample = next(iter(rows.values()))
    share = max(point[1] for point in platforms.load("thetagpu").matmul.efficiency)  # the kit's share for large operations
    memory = platforms.load("thetagpu").memory.efficiency
    peer = json.loads(subprocess.run([args.peer_python, "-c", PEER, ",".join(GPUS.values()), str(sample["batch"]),
                                      str(sample["seq_len"]), str(share), str(memory)],
                                     capture_output=True, text=True, check=True).stdout)
    print(f"GPT-2 medium, {sample['batch']} sequences of {sample['seq_len']} tokens, 1 GPU (DDP: no communication); "
          f"llm-analysis at flops_efficiency {share} and hbm_memory_efficiency {memory}, the kit's own shares")
    print(f"{'profile':<10}{'precision':>10}{'kit step s':>12}{'kit matrix s':>14}{'kit TFLOP':>11}"
          f"{'peer step s':>13}{'peer TFLOP':>12}  peer gpu")
    for (name, precision), figures in rows.items():
        theirs = peer[GPUS[name]]
        print(f"{name:<10}{precision:>10}{figures['step_s']:>12.3f}{figures['matrix_s']:>14.3f}{figures['flops'] / 1e12:>11.1f}"
              f"{theirs['latency_per_iter']:>13.3f}{theirs['num_flops_total_per_micro_batch'] * figures['batch'] / 8 / 1e12:>12.1f}"
              f"  {GPUS[name]} (fp16 peak)")
    print("peer forward breakdown (s): " + json.dumps({gpu: {k: round(v, 4) for k, v in figures.items() if k.startswith("latency_fwd")}
                                                       for gpu, figures in peer.items()}))


if __name__ == "__main__":
    main()
