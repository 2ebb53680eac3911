"""The plumbing of `make gpu-check` and `make bench`, dry-run on CPU with tiny models."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO


@pytest.mark.end_to_end
def test_gpu_check_dry_run_on_cpu_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--scale", "smoke", "--steps", "7",
         "--only", "gpt2:ddp,vgg16:megatron", "--out", str(out)],
        capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "REPRO_DATA": str(REPO / "data")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["fused_ops"] == {"status": "skipped: no CUDA device"}
    gpt2, vgg16 = report["cells"]
    assert "error" not in gpt2, gpt2.get("error")
    assert gpt2["samples_per_s"] > 0
    assert gpt2["tokens_per_s"] == pytest.approx(gpt2["samples_per_s"] * 64)
    assert gpt2["mfu"] is None  # a CPU is not in the peak table: no guessed MFU
    assert gpt2["memory_method"] == "cpu_peak_rss" and gpt2["peak_allocated_bytes"] > 0
    assert "targets transformers" in vgg16["error"]


@pytest.mark.units
def test_a_cell_past_its_time_limit_is_killed_with_its_whole_tree(tmp_path: Path) -> None:
    """A hung cell must not take a lease's minutes: it and every process under it (repro run starts
    torchrun in a session of its own) are killed, and the cells after it get what is left of --budget."""
    import importlib.util

    import psutil

    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    grandchild = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
              f" start_new_session=True); open({str(grandchild)!r}, 'w').write(str(p.pid)); print('started', flush=True);"
              " time.sleep(60)")
    started = time.monotonic()
    code, stdout, stderr = gpu_check.run_cell([sys.executable, "-c", script], tmp_path, timeout=10)  # time to start two Pythons on a busy machine
    assert code is None and "started" in stdout and "killed after 10 s" in stderr
    assert time.monotonic() - started < 40
    pid = int(grandchild.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    limits = gpu_check.Limits(cell_s=100, budget_s=30)
    assert 29 < limits.left() <= 30 and not limits.spent()
    assert gpu_check.Limits(budget_s=gpu_check.MIN_CELL_S - 1).spent()


@pytest.mark.units
def test_mfu_comes_from_the_peak_table_only() -> None:
    from repro.hardware import mfu

    assert mfu("NVIDIA H200", "bf16", 494.5e12) == pytest.approx(0.5)
    assert mfu("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12) == pytest.approx(1.0)
    assert mfu("Some Future GPU", "bf16", 1e15) is None


@pytest.mark.units
def test_an_overhead_is_judged_only_where_its_interval_clears_the_goal() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from run import interval95, overhead_met, verdict

    assert verdict([-0.004, 0.019], 0.02) is True
    assert verdict([0.021, 0.05], 0.02) is False
    assert verdict([-0.01, 0.03], 0.02) is None  # holds the goal: cannot tell
    assert overhead_met(True, None) is True and overhead_met(None, True) is None
    assert overhead_met(True, False) is False  # the whole, seen directly, above the goal outweighs the parts
    low, high = interval95([0.01, 0.03])  # mean 2%, sd 1.41%, t(1) = 12.71
    assert (low, high) == pytest.approx((0.02 - 0.1271, 0.02 + 0.1271), abs=1e-4)
    low, high = interval95([0.0, 0.02] * 13)  # 26 values, 25 degrees of freedom: t(20) = 2.09, the wider
    assert high - 0.01 == pytest.approx(2.09 * 0.0101980 / 26 ** 0.5, rel=1e-4)


@pytest.mark.units
def test_the_loops_own_time_is_judged_as_a_share_of_the_kits_step() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from run import harness_share

    pairs = [{"kit": 0.035, "harness_us": 140.0}, {"kit": 0.035, "harness_us": 147.0}]  # 0.40% and 0.42%
    found = harness_share(pairs)
    assert found["us"] == 143.5 and found["share"] == pytest.approx(0.0041)
    low, high = found["interval95"]  # 0.41% +- 12.71 * 0.01414% / sqrt(2) = 0.127%
    assert (low, high) == pytest.approx((0.0041 - 0.00127, 0.0041 + 0.00127), abs=1e-5)
    assert found["goal"] == 0.01 and found["met"] is True
    assert harness_share([{"kit": 0.035, "harness_us": 700.0}, {"kit": 0.035, "harness_us": 1400.0}])["met"] is None
    assert harness_share([{"kit": 0.035, "harness_us": 700.0}, {"kit": 0.035, "harness_us": 710.0}])["met"] is False


@pytest.mark.units
def test_the_paired_estimate_stands_in_microseconds_beside_the_loops_own_time() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from run import paired_summary

    pairs = [{"kit": 0.0352, "minimal": 0.0350, "harness_us": 150.0},
             {"kit": 0.0354, "minimal": 0.0350, "harness_us": 160.0}]
    found = paired_summary({"pairs": pairs, "steps_per_block": 64, "warm_up": {}})
    assert found["overhead_us"] == pytest.approx(300.0) and found["harness"]["us"] == 155.0
    low, high = found["interval95_us"]  # 300 us +- 12.71 * 141.4 us / sqrt(2): the ratios' interval times 35 ms
    assert (low, high) == pytest.approx((300 - 1271, 300 + 1271), abs=1)


@pytest.mark.end_to_end
def test_the_paired_overhead_job_alternates_kit_and_baseline_blocks(tmp_path: Path) -> None:
    out = tmp_path / "paired.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "bench" / "paired.py"), "ddp", str(out), "2"],
        capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "REPRO_DATA": str(REPO / "data"), "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["world"] == 2 and found["steps_per_block"] == 64  # the smoke epoch: 1024 samples, 8 x 2 a step
    assert found["warm_up"]["max_weight_difference"] == 0.0  # one epoch each: both sides trained alike, bit for bit
    assert [pair["first"] for pair in found["pairs"]] == ["kit", "minimal"]  # the warm-up pair is left out
    assert [pair["kit_steps"] for pair in found["pairs"]] == [64, 64]  # no warm-up steps after the first block
    assert all(0 < pair[side] < 1 for pair in found["pairs"] for side in ("kit", "minimal"))
    assert all(0 < pair["harness_us"] < pair["kit"] * 1e6 for pair in found["pairs"])  # the loop's own time, a part of a step


@pytest.mark.units
def test_memory_peer_asks_the_estimators_about_the_recipes_cells() -> None:
    """bench/memory_peer.py hands llm-analysis the kit's cells as the recipe sets them: DDP and ZeRO at micro-
    batches of 8 accumulated 4 times with full recompute (llm-analysis's 2), Megatron's tp group 4 x tp
    sequences a pass, no sequence parallelism; a peer that is not installed gives no figures, not an error."""
    sys.path.insert(0, str(REPO / "bench"))
    import memory_peer

    args = {row.label: memory_peer.peer_args(row, memory_peer.kit(row)[0]) for row in memory_peer.rows(64)}
    assert args["ddp"] == {"batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, "seq_len": 1024,
                           "activation_recomputation": 2, "ds_zero": 0, "tp_size": 1, "sp_size": 1, "total_num_gpus": 64}
    assert [args[f"zero-{s}"]["ds_zero"] for s in (1, 2, 3)] == [1, 2, 3]
    assert {key: args["megatron tp=8"][key] for key in ("batch_size_per_gpu", "gradient_accumulation_steps", "tp_size")} == {
        "batch_size_per_gpu": 32, "gradient_accumulation_steps": 8, "tp_size": 8}
    assert memory_peer.llm_analysis(sys.executable, args["ddp"]) is None  # this environment has no llm_analysis
