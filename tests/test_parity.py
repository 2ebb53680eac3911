"""`repro parity` catches a real break: DDP ranks that never all-reduce their gradients."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import mlflow_runs
from repro import names
from repro.model import costs
from repro.parity import CONFIGS, GLOBAL_BATCH, Config, Row, compare, control_for, recipe_for

# Loaded by every Python process whose path starts with the folder holding it (sitecustomize): in
# torchrun's workers, every DDP model gets a communication hook that keeps each rank's own gradient,
# the bug of a gradient never averaged across ranks.
# In every rank: one started fresh (torchrun's worker, a single rank: LOCAL_RANK at start), or forked from a
# warm fork server (repro.warm.fork_server: REPRO_WARM_PRELOAD is in its environment), which loads this first.
BREAK = '''
import os
if "LOCAL_RANK" in os.environ or "REPRO_WARM_PRELOAD" in os.environ:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    def local_gradient(state, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    original = DistributedDataParallel.__init__

    def broken(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.register_comm_hook(None, local_gradient)

    DistributedDataParallel.__init__ = broken
'''


@pytest.mark.units
def test_every_configuration_gets_the_same_global_batch_and_optimizer():
    recipes = {name: recipe_for(Config(name, fw, gpus, sets), "gpt2", "smoke", 4, [])
               for name, fw, gpus, sets in [("ddp-4", "ddp", 4, ()), ("gpipe", "torchgpipe", 2, ()),
                                            ("pd", "pipedream", 2, ()), ("tp", "megatron", 4, ("megatron.tp=2",))]}
    assert {n: r.train.batch_per_gpu for n, r in recipes.items()} == {"ddp-4": 2, "gpipe": 1, "pd": 8, "tp": 2}
    assert {(r.optimizer().name, r.optimizer().lr) for r in recipes.values()} == {("adam", 0.001)}  # megatron's own adamw overridden
    assert all(r.data.max_train_samples == 4 * GLOBAL_BATCH for r in recipes.values())


@pytest.mark.units
def test_a_difference_above_the_tolerance_fails_and_staleness_is_measured_not_judged():
    recipe = recipe_for(Config("ddp-2", "ddp", 2), "gpt2", "smoke", 3, [])
    reference = [5.5, 5.4, 5.3]
    same = compare(Config("ddp-2", "ddp", 2), recipe, [5.5, 5.4 + 4e-6, 5.3], reference, 3)
    off = compare(Config("ddp-2", "ddp", 2), recipe, [5.5, 5.4 + 4e-5, 5.3], reference, 3)
    stale = compare(Config("pd", "pipedream", 2, exact=False), recipe, [5.5, 5.6, 5.3], reference, 3)
    assert (same.status, off.status, stale.status) == ("pass", "FAIL", "measured")
    assert off.max_abs_diff == pytest.approx(4e-5) and stale.max_abs_diff == pytest.approx(0.2)
    assert compare(Config("ddp-2", "ddp", 2), recipe, [5.5], reference, 3).status.startswith("no losses")
    assert Row("x", "ddp", 2, "pass").max_abs_diff is None


@pytest.mark.end_to_end
def test_parity_fails_when_gradients_are_not_averaged(repro, tmp_path: Path):
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(BREAK)
    repro.env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "inject"), repro.env.get("PYTHONPATH", "")])
    result = repro("parity", "--configs", "ddp-2", "--steps", "3", "--reports", str(tmp_path / "reports"))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "parity fails for ddp-2" in result.stderr
    row = json.loads((tmp_path / "reports" / "parity.json").read_text())["rows"][0]
    assert row["name"] == "ddp-2" and row["status"] == "FAIL" and row["tolerance"] == 1e-5
    # the first step runs before any update: same weights, same samples, so the comparison itself is sound
    assert row["losses"][0] == pytest.approx(row["reference_losses"][0], abs=1e-5)
    assert row["max_abs_diff"] > 1e-3  # each rank stepped with half the batch's gradient
    assert "| ddp-2 | ddp | 2 |" in (tmp_path / "reports" / "parity.md").read_text()


@pytest.mark.units
def test_recompute_is_held_to_its_own_configuration_bit_for_bit_and_micro_batches_to_one_process_within_1e6():
    configs = {c.name: c for c in CONFIGS}
    dropout = configs["ddp-2-recompute-dropout"]
    control = recipe_for(control_for(dropout), "gpt2", "smoke", 4, [])
    test = recipe_for(dropout, "gpt2", "smoke", 4, [])
    assert (control.run.framework, control.run.gpus, control.model.dropout, control.train.recompute) == ("ddp", 2, 0.1, None)
    assert (test.model.dropout, test.train.recompute) == (0.1, "full")
    assert recipe_for(control_for(configs["torchgpipe-2-always"]), "gpt2", "smoke", 4, []).options().checkpoint == "except_last"
    assert compare(dropout, test, [5.5, 5.4], [5.5, 5.4], 2).status == "pass"
    off = compare(dropout, test, [5.5, 5.4 + 4.8e-7], [5.5, 5.4], 2)  # one rounding step: not the same arithmetic
    assert (off.status, off.tolerance) == ("FAIL", 0.0) and "against ddp-2-recompute-dropout without" in off.settings
    micro = configs["ddp-2-micro"]
    recipe = recipe_for(micro, "gpt2", "smoke", 4, [])
    assert (recipe.train.batch_per_gpu, recipe.train.micro_batch) == (4, 2)
    assert control_for(micro).name == "reference"
    assert compare(micro, recipe, [5.5, 5.4 + 2e-6], [5.5, 5.4], 2).status == "FAIL"  # within DDP's 1e-5, not 1e-6


@pytest.mark.end_to_end
@pytest.mark.parametrize("micro,recomputes", [
    ("ddp-2-micro", ["ddp-2-recompute-dropout"]), ("fsdp-2-micro", ["fsdp-2-recompute-dropout"]),
    ("megatron-tp2-micro", ["megatron-tp2-selective-dropout", "megatron-tp2-full-dropout"]),
    ("torch-1f1b-2-micro", []),  # torch's schedules take no recompute setting
], ids=["ddp", "fsdp", "megatron", "torch-1f1b"])
def test_recompute_changes_no_bit_and_micro_batches_stay_within_1e6(repro, tmp_path: Path, micro: str, recomputes: list[str]):
    result = repro("parity", "--configs", ",".join([micro, *recomputes]), "--steps", "3", "--reports", str(tmp_path / "reports"))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {row["name"]: row for row in json.loads((tmp_path / "reports" / "parity.json").read_text())["rows"]}
    for recompute in recomputes:
        assert rows[recompute]["max_abs_diff"] == 0.0 and rows[recompute]["status"] == "pass"
    assert rows[micro]["max_abs_diff"] <= 1e-6 and rows[micro]["status"] == "pass"
    # each run (the micro row, the recompute rows, their one control, the reference) checked the cost model against
    # its counters, its communication counted though it is shorter than the warm-up: every error within its bound
    # (dropout included), the FLOPs exact (recompute with dropout: SDPA's math path, no early stop)
    runs = mlflow_runs(repro.tracking_uri, "parity-smoke")
    assert len(runs) == 2 + (len(recomputes) + 1 if recomputes else 0)
    bounds = {**costs.BOUNDS, **costs.FLOP_BOUNDS}
    for run in runs:
        errors = [run.data.metrics[names.MODEL_CHECK.format(quantity, "error")] for quantity in bounds]
        assert all(error <= bound for error, bound in zip(errors, bounds.values())), (run.info.run_name, errors)


@pytest.mark.units
def test_vgg16_parity_has_its_own_reduced_model_and_no_megatron():
    from repro.parity import WORKLOAD_CONFIGS

    recipe = recipe_for(Config("ddp-4", "ddp", 4), "vgg16", "smoke", 4, [])
    assert (recipe.model.width_div, recipe.model.classifier_width, recipe.train.batch_per_gpu) == (16, 32, 2)
    assert recipe.optimizer().name == "adam" and recipe.data.max_train_samples == 4 * GLOBAL_BATCH
    assert recipe_for(Config("gpipe", "torchgpipe", 2), "vgg16", "smoke", 4, []).train.batch_per_gpu == 1
    assert not any(name.startswith("megatron") for name in WORKLOAD_CONFIGS["vgg16"])
    assert recipe_for(Config("fsdp-4", "fsdp", 4), "vgg16", "smoke", 4, []).train.batch_per_gpu == 2


@pytest.mark.units
def test_parting_tells_rounding_growth_from_the_frameworks():
    from repro.parity import parting

    reference = [2.30, 2.20, 2.10, 2.00, 1.90]
    rounding = parting("zero", "ddp", [2.30, 2.20 + 2e-7, 2.10 + 3e-6, 2.00 + 4e-4, 1.95], reference, [0.40, 0.50],
                       [0.20, 0.45], 1e-5, ("vgg16", 4))
    assert (rounding.first_step, rounding.beyond_step, rounding.steps) == (2, 4, 5)
    assert rounding.first_diff == pytest.approx(2e-7) and rounding.max_diff == pytest.approx(0.05)
    assert rounding.final_gap == pytest.approx(0.05 / 0.45) and rounding.cause.startswith("rounding growth")
    assert rounding.curve_gap == pytest.approx(1.0) and not rounding.control  # 0.40 against 0.20 at epoch 1
    broken = parting("fsdp", "ddp", [2.30, 2.25, 2.10, 2.00, 1.90], reference, [0.45], [0.45], 1e-5, ("vgg16", 4))
    assert broken.first_step == 2 and broken.cause.startswith("the frameworks: their first difference, at step 2")
    same = parting("fsdp", "ddp", reference, reference, [0.45], [0.45], 1e-5, ("vgg16", 4))
    assert same.first_step is None and same.cause.startswith("identical") and same.curve_gap == 0.0


@pytest.mark.units
def test_the_rounding_control_is_one_process_at_the_cells_global_batch_and_explains_the_gap():
    """The control differs from the matrix's DDP cell only in its process count (so in the order of its
    sums); the report's sentence compares the frameworks' curve gaps with the control's."""
    from repro.matrix import expand, load_matrix
    from repro.parity import parting, rounding_control, explanation

    cell = next(c for c in expand(load_matrix(rows=["ddp"]), "smoke", ["train.epochs=2"])
                if c.workload == "vgg16" and c.gpus == 4)
    control = rounding_control(cell)
    assert (control.run.gpus, control.train.batch_per_gpu) == (1, 4 * cell.recipe.train.batch_per_gpu)
    assert (control.train.epochs, control.seed, control.optimizer()) == (2, cell.recipe.seed, cell.recipe.optimizer())
    reference = [2.3, 2.2, 2.1]
    zero = parting("zero", "ddp", [2.3, 2.2 + 2e-7, 2.1 + 1e-3], reference, [0.30, 0.66], [0.30, 0.60], 1e-5, ("vgg16", 4))
    one = parting("one process (batch 64)", "ddp", [2.3 + 1e-7, 2.2, 2.1 + 1e-2], reference, [0.24, 0.60],
                  [0.30, 0.60], 1e-5, ("vgg16", 4), control=True)
    two = parting("zero", "ddp", reference, reference, [0.3, 0.5], [0.3, 0.5], 1e-5, ("vgg16", 2))
    found = explanation([two, zero, one])
    assert found[0] == ("vgg16 at 2 GPUs: largest per-epoch gap from ddp's curve: zero 0.0% (identical at every step: "
                        "the frameworks' sums over the ranks agree bit for bit here, so there is no rounding difference "
                        "to grow; over two ranks each gradient element is one addition, which rounds alike in either order).")
    assert found[1] == ("vgg16 at 4 GPUs: largest per-epoch gap from ddp's curve: zero 10.0%; one process (batch 64), "
                        "which differs from ddp only in the order of its sums (first loss difference 1.0e-07 at step 1), "
                        "20.0%: within the gap rounding alone makes: rounding growth, not the frameworks.")
    wide = parting("fsdp", "ddp", reference, [2.3, 2.2, 2.0], [0.1, 0.6], [0.3, 0.6], 1e-5, ("vgg16", 4))
    assert explanation([wide, one])[0].endswith("fsdp 66.7%; one process (batch 64), which differs from ddp only in "
                                                "the order of its sums (first loss difference 1.0e-07 at step 1), "
                                                "20.0%: 3.3x the gap rounding alone makes.")

@pytest.mark.units
def test_matrix_partings_read_the_matrix_runs_and_the_rounding_control(tmp_path: Path):
    """From MLflow: the matrix's ZeRO run against DDP's at 4 GPUs, and the rounding control from the parity
    experiment, each with its first differing step and its curve gap against DDP's curve."""
    from repro import events, names, tracking
    from repro.matrix import expand, load_matrix
    from repro.parity import matrix_partings, rounding_control

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cells = {c.row: c for c in expand(load_matrix(rows=["ddp", "zero"]), "smoke")
             if c.workload == "vgg16" and c.gpus == 4}
    ranks = [{"rank": 0, "peak_bytes": 1, "method": "cpu_peak_rss", "parameters": 1, "gradients": 0, "optimizer": 0}]

    def record(experiment: str, fingerprint: str, losses: list[float], val: list[float]) -> None:
        run = tracking.Run.create(uri, experiment, "run", {names.RECIPE_SHA256: fingerprint}, {})
        run.log_events([{"event": events.STEP, "wall": 1.0e9, "step": step, "loss": loss}
                        for step, loss in enumerate(losses, 1)] +
                       [{"event": events.EPOCH, "wall": 1.0e9, "epoch": epoch, "epoch_s": 1.0, "elapsed_s": epoch + 1.0,
                         "samples_per_s": 100.0, "val": {names.VAL_ACCURACY: value}, "ranks": ranks}
                        for epoch, value in enumerate(val)])
        run.end("FINISHED")

    record("table2-smoke", cells["ddp"].recipe.fingerprint(), [2.3, 2.2, 2.1], [0.30, 0.60])
    record("table2-smoke", cells["zero"].recipe.fingerprint(), [2.3, 2.2 + 2.4e-7, 2.1 + 1e-3], [0.30, 0.66])
    record("parity-smoke", rounding_control(cells["ddp"]).fingerprint(), [2.3 + 2.4e-7, 2.2, 2.1 + 1e-2], [0.24, 0.60])
    zero, control = matrix_partings(uri, "table2-smoke", "smoke", "parity-smoke", gpus=(4,), rows=("zero",),
                                    execute=False)
    assert (zero.framework, zero.first_step, zero.beyond_step, zero.control) == ("zero", 2, 3, False)
    assert zero.curve_gap == pytest.approx(0.1) and zero.final_gap == pytest.approx(0.1)
    assert (control.framework, control.first_step, control.control) == ("one process (batch 64)", 1, True)
    assert control.curve_gap == pytest.approx(0.2) and control.max_diff == pytest.approx(1e-2)
