"""Each framework's own time (repro.framework_overhead): which runs measure it, and the arithmetic that turns
their measured steps into the profile's figures. Whether the model then holds on the matrix's cells is
reports/model_check.md's check on the main job: timing on a shared test machine is no number for a unit test."""
from __future__ import annotations

import dataclasses

import pytest

from repro import calibrate, framework_overhead, registry
from repro.cell import Cell
from repro.matrix import expand, load_matrix
from repro.model import costs, platforms, time
from repro.report import collect, model_check
from test_time import cpu_profile

pytestmark = pytest.mark.units


def test_the_calibration_runs_are_the_checked_cells_at_two_sizes_the_check_does_not_use_and_at_their_own():
    """At 2 cores: every matrix cell of 1 or 2 processes (torchgpipe's 4 GPUs are one), once per recipe, at a
    size below the recipe's, the recipe's own and one above, one after another, 20 steps each, each size its own
    row so the reports do not fold them; all of them in each of 3 passes, each later pass's runs their own
    (another seed), in the first's order. The runs at the recipe's own size are the check's alone."""
    cells = framework_overhead.calibration_cells("smoke", 2)
    assert framework_overhead.PASSES == 3
    each = len(cells) // 3
    first, *later = cells[:each], cells[each:2 * each], cells[2 * each:]
    for number, cells_of_pass in enumerate(later, 1):
        assert [c.repeat for c in first] == [0] * each and [c.repeat for c in cells_of_pass] == [number] * each
        assert [(c.workload, c.row.replace("pass 1", f"pass {number + 1}"), c.gpus) for c in first] == [
            (c.workload, c.row, c.gpus) for c in cells_of_pass]
        assert [c.recipe.seed for c in cells_of_pass] == [c.recipe.seed + 1000 * number for c in first]
    finished = [collect.Result(c, "FINISHED", epoch_s=[1.0]) for c in cells]
    assert [r.cell for r in collect.fold_repeats(finished)] == cells  # every pass's run is read, none folded away
    assert all(registry.plan_class(c.framework).processes(c.recipe) <= 2 for c in cells)
    assert len({c.recipe.fingerprint() for c in cells}) == len(cells) == len({c.label for c in cells})
    assert all(c.recipe.train.max_steps == framework_overhead.STEPS for c in cells)
    size = {c.label: c.recipe.model.d_model if c.workload == "gpt2" else c.recipe.model.width_div for c in cells}
    assert [size[c.label] for c in first[:3]] == [32, 64, 128]  # the first cell, GPT-2 DDP at 1 process
    assert {(c.workload, size[c.label]) for c in cells if framework_overhead.at_checked_size(c)} == {("gpt2", 64), ("vgg16", 8)}
    assert {(c.workload, size[c.label]) for c in cells if not framework_overhead.at_checked_size(c)} == {
        ("gpt2", 32), ("gpt2", 128), ("vgg16", 16), ("vgg16", 4)}
    keys = {}
    for cell in cells:
        keys.setdefault(time.framework_key(costs.cell_of(cell.recipe)), []).append(cell)
    assert all(len(runs) == 9 for runs in keys.values())  # the three sizes of each cell, in every pass, share its key
    assert {(c.workload, c.framework, c.gpus) for c in cells} >= {("gpt2", "torchgpipe", 4), ("vgg16", "fsdp", 2)}
    assert not any(c.gpus == 4 and c.framework != "torchgpipe" for c in cells)


def test_a_frameworks_own_time_is_its_measured_step_less_the_models_terms_the_median_of_its_passes(monkeypatch):
    """Runs whose median step is 30 ms (DDP, PipeDream) and 45 ms (FSDP) at 1 process, 2,000 us of each the loop's own
    (framework_median), in three passes, one of each framework's passes off: DDP's first 60% slow, FSDP's second and
    PipeDream's third 40% fast. Each framework's own time is its step less the model's terms, the median of its
    passes: the off pass in either direction moves nothing (the least of them would keep FSDP's and PipeDream's fast
    spells), so FSDP keeps 15 ms more than DDP and PipeDream at both sizes, plus the difference of the model's terms."""
    cells = framework_overhead.calibration_cells("smoke", 2)
    picked = [c for c in cells if c.workload == "gpt2" and c.gpus == 1 and c.framework in ("ddp", "pipedream", "fsdp")]
    assert len(picked) == 27  # three frameworks at three sizes, in every pass
    step = {"ddp": 0.030, "pipedream": 0.030, "fsdp": 0.045}
    off = {("ddp", 0): 1.6, ("fsdp", 1): 0.6, ("pipedream", 2): 0.6}  # (framework, pass): its runs' speed factor
    results = [collect.Result(c, "FINISHED", epoch_s=[1.0], step_s={
        "framework_median": [step[c.framework] * off.get((c.framework, c.repeat), 1.0) - 0.002]}) for c in picked]
    # collect reads the runs of the cells it is given: the runs at the recipe's size are never asked for
    monkeypatch.setattr(collect, "collect", lambda cells, *args: [r for r in results if r.cell in cells])
    platform = cpu_profile()
    table = framework_overhead.own_times(picked, "sqlite:///unused.db", platform)
    model = {(c.framework, costs.cell_of(c.recipe).shape): costs.cell_of(c.recipe) for c in picked
             if not framework_overhead.at_checked_size(c)}
    for (framework, size), m in model.items():
        own = dict(table[time.framework_key(m)])[time.own_time_scale(m)]
        assert own == pytest.approx(step[framework] - 0.002 - time.model_terms(m, platform).total_s, abs=1e-12)
    assert len(table) == 3 and all(len(points) == 2 for points in table.values())
    step_of = {key: dict(table[time.framework_key(m)])[time.own_time_scale(m)] + time.model_terms(m, platform).total_s
               for key, m in model.items()}  # own time and terms: the step the model gives back at each size
    assert sorted(round(step_of[("fsdp", size)] - step_of[("ddp", size)], 12) for f, size in model if f == "ddp") == [0.015, 0.015]
    assert calibrate.TINY["gpt2"][1] == "model.n_head=2"  # Megatron's tp=2 needs heads for both ranks at every size


def test_a_kept_profile_gets_its_frameworks_own_times_anew_against_the_model_of_now(monkeypatch, tmp_path):
    """A profile kept with own times the model of its day measured: the store's runs are reused (none run again)
    and the model's present terms subtracted from them, so a changed model is never read against old terms."""
    path = tmp_path / "platform.yaml"
    stale = dataclasses.replace(cpu_profile(), frameworks={"gpt2 ddp 1g old": [[1.0, 9.0], [2.0, 9.0]]}, path=str(path))
    monkeypatch.setattr(calibrate, "calibrated", lambda folder, again: pytest.fail("a kept profile is measured again"))
    monkeypatch.setattr(calibrate, "kept", lambda path: stale)
    monkeypatch.setattr(calibrate, "remeasured", lambda profile: pytest.fail("a kept profile is measured again"))
    trained = []
    monkeypatch.setattr(framework_overhead.parity, "train", lambda recipes, *args, **kwargs: trained.append(len(recipes)))
    cells = framework_overhead.calibration_cells("smoke", 2)[:2]
    results = [collect.Result(c, "FINISHED", epoch_s=[1.0], step_s={"framework_median": [0.028]}) for c in cells]
    monkeypatch.setattr(collect, "collect", lambda *args: results)
    profile = framework_overhead.Calibration(f"sqlite:///{tmp_path}/mlflow.db", 2).finished(lambda line: None)
    every = len(framework_overhead.calibration_cells("smoke", 2))
    assert trained == [every // framework_overhead.PASSES] * framework_overhead.PASSES  # pass by pass
    assert list(profile.frameworks) == [time.framework_key(costs.cell_of(cells[0].recipe))]
    assert platforms.load(path).frameworks == profile.frameworks


def test_a_profile_measured_now_is_measured_again_after_each_pass_of_the_runs(monkeypatch, tmp_path):
    """Where the machine is measured now, it is measured once more after each pass, minutes apart, and the
    passes' runs are made between (calibrate.fastest keeps each figure's fastest)."""
    path = tmp_path / "platform.yaml"
    platforms.dump(cpu_profile(), path)
    fresh = platforms.load(path)
    monkeypatch.setattr(calibrate, "calibrated", lambda folder, again: fresh)
    monkeypatch.setattr(calibrate, "kept", lambda path: None)  # none kept: measured now
    events = []
    monkeypatch.setattr(calibrate, "remeasured", lambda profile: events.append("measure") or fresh)
    monkeypatch.setattr(framework_overhead.parity, "train",
                        lambda recipes, *args, **kwargs: events.append({r.fingerprint() for r in recipes}))
    monkeypatch.setattr(collect, "collect", lambda *args: [])
    framework_overhead.Calibration(f"sqlite:///{tmp_path}/mlflow.db", 2).finished(lambda line: None)
    cells = framework_overhead.calibration_cells("smoke", 2)
    passes = [{c.recipe.fingerprint() for c in cells if c.row.endswith(f" pass {n}")}
              for n in range(1, framework_overhead.PASSES + 1)]
    assert events == [step for runs in passes for step in (runs, "measure")]
    assert len(set().union(*passes)) == sum(map(len, passes)) == len(cells)


def test_each_recipes_first_pass_runs_beside_its_matrix_run_once_where_the_store_lacks_them(monkeypatch, tmp_path):
    """The matrix runner asks, after each of its cells, for the calibration runs to make right after it: the
    first pass's three of that recipe (below its size, at it, above), once per recipe (megatron-intra and -data
    at 1 GPU share one), none the store holds, none for a cell the check does not read (4 processes); over the
    whole matrix, every run of the first pass exactly once."""
    monkeypatch.setattr(calibrate, "kept", lambda path: cpu_profile())  # kept: nothing measured
    held = set()
    monkeypatch.setattr("repro.table2.held_fingerprints", lambda uri, experiment, retry_failed: held)
    calibration = framework_overhead.Calibration(f"sqlite:///{tmp_path}/mlflow.db", 2)
    matrix = {c.label: c for c in expand(load_matrix(), "smoke")}
    first = [c for c in framework_overhead.calibration_cells("smoke", 2) if c.row.endswith(" pass 1")]

    ddp = calibration.beside(matrix["gpt2 ddp 1g"])
    assert [label for label, _, _ in ddp] == [f"calibrate gpt2 ddp [{size}] pass 1 1g" for size in
                                              ("model.d_model=32 model.n_head=2", "recipe's size",
                                               "model.d_model=128 model.n_head=8")]
    assert {experiment for _, _, experiment in ddp} == {framework_overhead.EXPERIMENT}
    assert ddp[1][1].fingerprint() == framework_overhead.at_steps(matrix["gpt2 ddp 1g"].recipe).fingerprint()
    assert [recipe.train.max_steps for _, recipe, _ in ddp] == [framework_overhead.STEPS] * 3
    assert len(calibration.beside(matrix["gpt2 megatron-data 1g"])) == 3
    assert calibration.beside(matrix["gpt2 megatron-intra 1g"]) == []  # the same recipe: calibrated once
    assert calibration.beside(matrix["gpt2 ddp 4g"]) == []
    assert calibration.beside(matrix["gpt2 ddp 1g"]) == []  # asked again (a retried cell): made once

    held.add(next(c for c in first if c.label == "vgg16 zero [model.width_div=16] pass 1 1g").recipe.fingerprint())
    assert [label for label, _, _ in calibration.beside(matrix["vgg16 zero 1g"])] == [
        "calibrate vgg16 zero [recipe's size] pass 1 1g", "calibrate vgg16 zero [model.width_div=4] pass 1 1g"]

    held.clear()
    everything = framework_overhead.Calibration(f"sqlite:///{tmp_path}/mlflow.db", 2)
    made = [recipe.fingerprint() for cell in matrix.values() for _, recipe, _ in everything.beside(cell)]
    assert sorted(made) == sorted(c.recipe.fingerprint() for c in first)


def test_the_check_reads_a_cell_at_the_median_of_its_runs_and_its_retimings_at_the_recipes_size(monkeypatch):
    """The calibration's runs at the recipe's own size, keyed by the framework's settings and the model's shape,
    are read beside the matrix's run of the same cell: the row's measured step is the median of the four (26 ms:
    neither the matrix run's 30 nor the fastest retiming's 22), its timings all four; a cell of other settings
    (2 processes) reads none of them."""
    cells = framework_overhead.calibration_cells("smoke", 2)
    again = [c for c in cells if framework_overhead.at_checked_size(c) and c.workload == "gpt2" and c.framework == "ddp" and c.gpus == 1]
    assert [c.repeat for c in again] == [0, 1, 2]
    results = [collect.Result(c, "FINISHED", epoch_s=[1.0], step_s={"framework_median": [t]})
               for c, t in zip(again, (0.025, 0.022, 0.027))]
    monkeypatch.setattr(collect, "collect", lambda cells, *args: [r for r in results if r.cell in cells])
    retimed = framework_overhead.retimed(cells, "sqlite:///unused.db")
    model = costs.cell_of(again[0].recipe)
    assert retimed == {(time.framework_key(model), model.shape): [0.025, 0.022, 0.027]}
    platform = cpu_profile()
    matrix = cell_for_matrix("gpt2", "ddp", 1)
    row = step_time_row(collect.Result(matrix, "FINISHED", epoch_s=[1.0], step_s={"framework_median": [0.030]}), platform, retimed)
    assert row["timings"] == [0.030, 0.025, 0.022, 0.027] and row["measured"] == pytest.approx(0.026)
    assert row["error"] == pytest.approx(abs(0.026 - row["modelled"]) / 0.026)
    other = step_time_row(collect.Result(cell_for_matrix("gpt2", "ddp", 2), "FINISHED", epoch_s=[1.0],
                                         step_s={"framework_median": [0.030]}), platform, retimed)
    assert (other["measured"], other["timings"]) == (0.030, [0.030])


def cell_for_matrix(workload: str, row: str, gpus: int) -> Cell:
    """The main job's cell of `row` at `gpus` on the smoke scale."""
    return next(c for c in expand(load_matrix(), "smoke") if (c.workload, c.row, c.gpus) == (workload, row, gpus))


def step_time_row(result: collect.Result, platform: platforms.Platform, retimed: dict) -> dict:
    checked = model_check.check(result, platform, 2, retimed)
    return next(row for row in checked["rows"] if row["quantity"] == "step_time")
