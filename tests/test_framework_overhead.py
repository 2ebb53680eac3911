"""Each framework's own time (repro.framework_overhead): which runs measure it, and the arithmetic that turns
their measured steps into the profile's figures. Whether the model then holds on the matrix's cells is
reports/model_check.md's check on the main job: timing on a shared test machine is no number for a unit test."""
from __future__ import annotations

import dataclasses

import pytest

from repro import calibrate, framework_overhead, registry
from repro.model import costs, platforms, time
from repro.report import collect
from test_time import cpu_profile

pytestmark = pytest.mark.units


def test_the_calibration_runs_are_the_checked_cells_at_two_sizes_the_check_does_not_use():
    """At 2 cores: every matrix cell of 1 or 2 processes (torchgpipe's 4 GPUs are one), once per recipe, at the
    negligible size and the larger one, 20 steps each, each size its own row so the reports do not fold them;
    all of them in each of 2 passes, the second pass's runs their own (another seed), in the first's order."""
    cells = framework_overhead.calibration_cells("smoke", 2)
    assert framework_overhead.PASSES == 2
    first, second = cells[:len(cells) // 2], cells[len(cells) // 2:]
    assert [c.repeat for c in first] == [0] * len(first) and [c.repeat for c in second] == [1] * len(first)
    assert [(c.workload, c.row.replace("pass 1", "pass 2"), c.gpus) for c in first] == [(c.workload, c.row, c.gpus) for c in second]
    assert [c.recipe.seed for c in second] == [c.recipe.seed + 1000 for c in first]
    finished = [collect.Result(c, "FINISHED", epoch_s=[1.0]) for c in cells]
    assert [r.cell for r in collect.fold_repeats(finished)] == cells  # every pass's run is read, none folded away
    assert all(registry.plan_class(c.framework).processes(c.recipe) <= 2 for c in cells)
    assert len({c.recipe.fingerprint() for c in cells}) == len(cells) == len({c.label for c in cells})
    assert all(c.recipe.train.max_steps == framework_overhead.STEPS for c in cells)
    sizes = {(c.workload, c.recipe.model.d_model if c.workload == "gpt2" else c.recipe.model.width_div) for c in cells}
    assert sizes == {("gpt2", 8), ("gpt2", 128), ("vgg16", 64), ("vgg16", 4)}  # smoke: d_model 64, width_div 8
    keys = {}
    for cell in cells:
        keys.setdefault(time.framework_key(costs.cell_of(cell.recipe)), []).append(cell)
    assert all(len(runs) == 4 for runs in keys.values())  # both sizes of each cell, in both passes, share its key
    assert {(c.workload, c.framework, c.gpus) for c in cells} >= {("gpt2", "torchgpipe", 4), ("vgg16", "fsdp", 2)}
    assert not any(c.gpus == 4 and c.framework != "torchgpipe" for c in cells)


def test_a_frameworks_own_time_is_its_measured_step_less_the_models_terms_and_the_loops_own_cost(monkeypatch):
    """Runs whose median step is 30 ms (DDP, PipeDream) and 45 ms (FSDP) at 1 process in the faster of two passes
    (DDP's first and FSDP's second 60% slower), 2,000 us of each the loop's own (framework_median): each framework
    step less the model's terms, less the loop's cost at that size, the least such residual of the one-process DDP
    and PipeDream runs there (they add nothing to a plain step), the faster pass kept. So DDP and PipeDream keep 0
    at both sizes and FSDP keeps 15 ms plus the difference of the model's terms."""
    cells = framework_overhead.calibration_cells("smoke", 2)
    picked = [c for c in cells if c.workload == "gpt2" and c.gpus == 1 and c.framework in ("ddp", "pipedream", "fsdp")]
    assert len(picked) == 12  # three frameworks at both sizes, in both passes
    step = {"ddp": 0.030, "pipedream": 0.030, "fsdp": 0.045}
    slow = {("ddp", 0), ("fsdp", 1)}  # (framework, pass) whose runs were 60% slow
    results = [collect.Result(c, "FINISHED", epoch_s=[1.0], step_s={
        "framework_median": [step[c.framework] * (1.6 if (c.framework, c.repeat) in slow else 1.0) - 0.002]})
               for c in picked]
    monkeypatch.setattr(collect, "collect", lambda *args: results)
    platform = cpu_profile()
    table = framework_overhead.own_times(picked, "sqlite:///unused.db", platform)
    model = {(c.framework, costs.cell_of(c.recipe).shape): costs.cell_of(c.recipe) for c in picked}
    terms = {key: time.model_terms(m, platform).total_s for key, m in model.items()}
    loop = {size: min(0.028 - terms[(f, s)] for (f, s) in terms if s == size and f != "fsdp") for _, size in terms}
    for (framework, size), m in model.items():
        own = dict(table[time.framework_key(m)])[float(costs.predict(m).model_state)]
        assert own == pytest.approx(step[framework] - 0.002 - terms[(framework, size)] - loop[size], abs=1e-12)
    assert len(table) == 3 and all(len(points) == 2 for points in table.values())
    fsdp = [dict(table[time.framework_key(m)]) for (f, _), m in model.items() if f == "fsdp"][0]
    assert min(fsdp.values()) > 0.010  # FSDP's 15 ms more a step, less the model's extra terms for it
    assert calibrate.TINY["gpt2"][1] == "model.n_head=2"  # Megatron's tp=2 needs heads for both ranks at every size


def test_a_kept_profile_gets_its_frameworks_own_times_anew_against_the_model_of_now(monkeypatch, tmp_path):
    """A profile kept with own times the model of its day measured: the store's runs are reused (none run again)
    and the model's present terms subtracted from them, so a changed model is never read against old terms."""
    path = tmp_path / "platform.yaml"
    stale = dataclasses.replace(cpu_profile(), frameworks={"gpt2 ddp 1g old": [[1.0, 9.0], [2.0, 9.0]]}, path=str(path))
    monkeypatch.setattr(calibrate, "calibrated", lambda folder, again: stale)
    trained = []
    monkeypatch.setattr(framework_overhead.parity, "train", lambda recipes, *args, **kwargs: trained.append(len(recipes)))
    cells = framework_overhead.calibration_cells("smoke", 2)[:2]
    results = [collect.Result(c, "FINISHED", epoch_s=[1.0], step_s={"framework_median": [0.028]}) for c in cells]
    monkeypatch.setattr(collect, "collect", lambda *args: results)
    profile = framework_overhead.calibrated(f"sqlite:///{tmp_path}/mlflow.db", lambda line: None, 2)
    assert trained == [len(framework_overhead.calibration_cells("smoke", 2))]
    assert list(profile.frameworks) == [time.framework_key(costs.cell_of(cells[0].recipe))]
    assert platforms.load(path).frameworks == profile.frameworks
