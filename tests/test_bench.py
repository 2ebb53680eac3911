"""The plumbing of `make gpu-check` and `make bench`, dry-run on CPU with tiny models."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


@pytest.mark.slow
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


def test_mfu_comes_from_the_peak_table_only() -> None:
    from repro.hardware import mfu

    assert mfu("NVIDIA H200", "bf16", 494.5e12) == pytest.approx(0.5)
    assert mfu("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12) == pytest.approx(1.0)
    assert mfu("Some Future GPU", "bf16", 1e15) is None
