"""Measuring without disturbing: the loop's host synchronisations per step are counted and fixed, and
step times come out as a distribution. One in-process rank on gloo; about 10 s."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from repro import batches, events, loop, names, tracking
from repro.data.sets import dataset
from repro.metrics import WARMUP_STEPS, Stopwatch, framework_median, step_time_summary
from repro.recipe import load_file, recipe_path
from repro.runfiles import EVENTS_FILE
from host import free_port

STEPS = 40  # 320 samples / batch 8: one epoch, two full windows of loop.SYNC_EVERY and a partial one
# Tensor methods that wait for the device, and collectives that wait for peers.
TENSOR_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")
COLLECTIVES = ("all_reduce", "barrier", "all_gather_object", "broadcast", "all_gather", "reduce")


@pytest.fixture
def trainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A one-rank DDP trainer of the smoke GPT-2 in this process, on its own gloo process group."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    threads = torch.get_num_threads()
    recipe = load_file(recipe_path("gpt2", "smoke"), [
        "run.framework=ddp", "run.gpus=1", "train.epochs=1", "data.max_train_samples=320", "data.max_val_samples=32",
    ])
    built = loop.Trainer(recipe, tmp_path, dataset(recipe.data.dataset).locate())
    yield built
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads)


def observe_loop_syncs(trainer: loop.Trainer, monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts, by name, every tensor read and collective that the trainer itself calls during the timed steps."""
    seen: Counter = Counter()

    def watch(owner: object, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            caller = sys._getframe(1)  # the trainer's own methods (its sampler slices CPU index tensors)
            if caller.f_locals.get("self") is trainer and trainer.phase == "steps":
                seen[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for name in TENSOR_READS:
        watch(torch.Tensor, name)
    for name in COLLECTIVES:
        watch(dist, name)
    return seen


@pytest.mark.ranks
def test_the_loop_synchronises_once_per_window_and_reads_the_stop_vote_every_few_steps(trainer, monkeypatch):
    seen = observe_loop_syncs(trainer, monkeypatch)
    assert trainer.run() == 0
    assert trainer.window == loop.SYNC_EVERY == 16
    # A stop vote after every 10th step (40 steps an epoch, 4 votes), read a step later (a CPU tensor: no
    # device wait); per window of 16 steps: one read of the reduced losses, a step after the window.
    assert trainer.vote_every == STEPS // loop.STOP_VOTES_PER_EPOCH == 10
    windows, votes_read = STEPS // loop.SYNC_EVERY, (STEPS - 1) // trainer.vote_every
    steps = {site: count for site, count in trainer.host_syncs.items() if site.startswith("steps/")}
    assert steps == {"steps/loss": windows, "steps/stop": votes_read}
    # Nothing in the loop reads a tensor or calls a collective in the timed steps without counting it.
    assert sum(seen.values()) == sum(steps.values()), seen
    assert trainer.host_syncs["epoch/loss"] == 1  # the partial window (steps 33-40), after the epoch timer


@pytest.mark.ranks
def test_a_stop_lands_a_step_after_the_next_vote(trainer, monkeypatch):
    train_step = trainer.adapter.train_step

    def signalled_at_step_7(inputs, targets):
        if trainer.steps_here == 6:  # the 7th step: the next vote starts after step 10, is read after 11
            trainer.on_signal(signal.SIGTERM, None)
        return train_step(inputs, targets)

    monkeypatch.setattr(trainer.adapter, "train_step", signalled_at_step_7)
    assert trainer.run() == 128 + signal.SIGTERM
    trainer.close(clean=False)
    written = events.read_all(trainer.run_dir / EVENTS_FILE)
    (interrupted,) = [e for e in written if e["event"] == events.INTERRUPTED]
    assert interrupted["step"] == 11 and interrupted["signal"] == "SIGTERM"
    assert [e["step"] for e in written if e["event"] == events.STEP] == list(range(1, 12))


@pytest.mark.ranks
def test_every_step_keeps_its_loss_and_the_epoch_reports_a_step_time_distribution(trainer, monkeypatch):
    counter, comm = trainer.adapter.activations, trainer.adapter.communication
    opened, counted = [], []
    monkeypatch.setattr(counter, "hooks", lambda: opened.append(trainer.steps_here) or type(counter).hooks(counter))
    monkeypatch.setattr(comm, "counting", lambda: counted.append(trainer.steps_here) or type(comm).counting(comm))
    assert trainer.run() == 0
    trainer.close(clean=True)
    written = events.read_all(trainer.run_dir / EVENTS_FILE)
    steps = [e for e in written if e["event"] == events.STEP]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(0 < e["loss"] < 10 for e in steps) and steps[-1]["loss"] < steps[0]["loss"]
    (epoch,) = [e for e in written if e["event"] == events.EPOCH]
    step_s = epoch["step_s"]
    assert step_s["count"] == STEPS - WARMUP_STEPS and step_s["warmup"] == WARMUP_STEPS
    assert 0 < step_s["p10"] <= step_s["median"] <= step_s["p90"]
    assert step_s["mean"] * step_s["count"] < epoch["epoch_s"]  # warm-up steps are left out
    # Activations are counted over the warm-up steps and one per process only, and still see the
    # peak that docs/memory.md derives by hand for the smoke GPT-2 at batch 8.
    assert opened == list(range(WARMUP_STEPS + 1))
    assert epoch["ranks"][0]["activation_peak_bytes"] == 9_253_380
    # Communication is counted over one step, the last warm-up step: one process's DDP still all-reduces
    # its one bucket, every gradient of the 220,544-parameter model (docs/memory.md).
    assert counted == [WARMUP_STEPS - 1]
    assert epoch["ranks"][0]["comm"] == {"bytes": {"all_reduce": 4 * 220_544}, "calls": {"all_reduce": 1}}
    (end,) = [e for e in written if e["event"] == events.END]
    assert end["host_syncs"]["steps/loss"] == STEPS // loop.SYNC_EVERY
    # The loop's own time between steps, a mean over all 40 steps, is positive and a small part of a step;
    # the hooks' callbacks, timed by the counter itself, are in the counters' time and not in it.
    loop_us = epoch["loop_us"]
    assert 0 < loop_us["harness"] < step_s["mean"] * 1e6
    assert loop_us["counters"] * STEPS >= counter.spent_ns / 1e3 > 0
    metrics = {key: value for key, value, _ in tracking.event_metrics(epoch)}
    assert (metrics[names.HARNESS_TIME], metrics[names.COUNTERS_TIME]) == (loop_us["harness"], loop_us["counters"])
    # the framework's step: each timed step less the loop's own time in it, the median of those
    assert 0 < step_s["framework_median"] < step_s["median"]
    assert metrics[names.STEP_TIME.format("framework_median")] == step_s["framework_median"]


@pytest.mark.ranks
def test_the_counters_time_is_kept_apart_from_the_loops_own(trainer, monkeypatch):
    """A counting context that takes 50 ms to open shows in `counters` (6 of 40 steps: 7.5 ms a step on
    average), not in `harness`."""
    class Slow:
        def __enter__(self) -> None:
            time.sleep(0.05)

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(trainer.adapter.activations, "hooks", Slow)
    assert trainer.run() == 0
    trainer.close(clean=True)
    (epoch,) = [e for e in events.read_all(trainer.run_dir / EVENTS_FILE) if e["event"] == events.EPOCH]
    counted = WARMUP_STEPS + 1  # one process
    assert epoch["loop_us"]["counters"] >= counted * 50_000 / STEPS
    assert epoch["loop_us"]["harness"] < counted * 50_000 / STEPS / 2


@pytest.mark.ranks
def test_in_process_batches_are_the_data_loaders(trainer):
    """The loop fetches batches without a DataLoader when it has no workers: the same tensors, bit for
    bit, whether a window's batches come in a row through the dataset's own collation (the smoke GPT-2's
    `TokenChunks.collated`; 20 batches: a window of 16 and 4) or one by one through `default_collate`."""
    sampler = batches.GlobalBatches(len(trainer.train_set), 16, (1, 2), seed=7, epoch=2)
    fetched = batches.batches(trainer.train_set, sampler, workers=0)
    theirs = list(torch.utils.data.DataLoader(trainer.train_set, batch_sampler=sampler))
    assert hasattr(trainer.train_set, "collated")
    for ours in (list(fetched), list(fetched.one_by_one())):
        assert len(ours) == len(theirs) == len(sampler) == 20
        assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(ours, theirs))
        # each batch its own storage, as the DataLoader's (the activation counter counts storages)
        assert all(a.untyped_storage().nbytes() == c.untyped_storage().nbytes() for (a, _), (c, _) in zip(ours, theirs))


@pytest.mark.units
def test_a_stopwatch_sums_its_stretches_per_step():
    watch = Stopwatch()
    for _ in range(3):
        watch.start()
        time.sleep(0.01)
        watch.stop()
    assert 30_000 <= watch.mean_us(1) < 60_000 and watch.mean_us(3) == watch.mean_us(1) / 3
    assert watch.mean_us(0) is None


@pytest.mark.units
def test_a_stopwatchs_laps_are_each_steps_share_and_the_framework_step_their_median_difference():
    watch = Stopwatch()
    watch.start()
    for pause in (0.01, 0.03):
        time.sleep(pause)
        watch.lap()
    watch.stop()
    assert [round(ns / 1e7) for ns in watch.laps] == [1, 3] and sum(watch.laps) <= watch.ns
    # a step whose loop share holds a 470 ms stall: the median of the differences
    # is the framework's 29 ms; the median step less the loop's mean would be negative
    assert framework_median([0.030, 0.500, 0.031], [1_000_000, 470_000_000, 2_000_000]) == pytest.approx(0.029)
    assert framework_median([], []) is None


@pytest.mark.units
def test_step_time_summary_gives_median_deciles_and_count():
    summary = step_time_summary([float(i) for i in range(1, 12)])  # 1..11 s
    assert summary == {"median": 6.0, "p10": 2.0, "p90": 10.0, "mean": 6.0, "count": 11}
    assert step_time_summary([])["count"] == 0 and step_time_summary([0.5])["p90"] == 0.5
    json.dumps(summary)  # goes into the epoch event as it is


# -- repeats ------------------------------------------------------------------------------------------

@pytest.mark.units
def test_repeats_run_with_their_own_seeds_and_the_first_keeps_the_recipe_fingerprint():
    from repro.matrix import expand, load_matrix

    matrix = load_matrix(rows=["ddp"])
    once, thrice = expand(matrix, "smoke"), expand(matrix, "smoke", repeats=3)
    assert len(thrice) == 3 * len(once)
    first, second, third = thrice[:3]
    assert [c.recipe.seed for c in (first, second, third)] == [1234, 2234, 3234]
    assert first.recipe.fingerprint() == once[0].recipe.fingerprint()  # a store without repeats is reused
    assert len({c.recipe.fingerprint() for c in thrice}) == len(thrice)  # each repeat resumes on its own
    assert (first.label, third.label) == ("gpt2 ddp 1g", "gpt2 ddp 1g #3")


@pytest.mark.units
def test_median_interval_is_the_sign_test_interval_with_its_coverage():
    from repro.report.collect import median_interval

    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)  # 3 repeats: min..max covers 75%
    low, high, coverage = median_interval([float(i) for i in range(10)])
    assert (low, high) == (1.0, 8.0) and coverage == pytest.approx(1 - 2 * 11 / 1024)


@pytest.mark.units
def test_repeats_fold_into_one_result_and_times_compare_only_when_intervals_separate():
    from repro.matrix import expand, load_matrix
    from repro.report.collect import Result, fold_repeats, not_separable

    matrix = load_matrix(rows=["ddp", "zero"])
    cells = [c for c in expand(matrix, "smoke", repeats=3) if c.gpus == 2 and c.workload == "gpt2"]
    times = {"ddp": [1.0, 1.1, 1.2], "zero": [1.15, 1.3, 1.4]}
    results = [Result(c, "FINISHED", epoch_s=[times[c.row][c.repeat]] * 2) for c in cells]
    ddp, zero = fold_repeats(results)
    assert (ddp.repeat_epoch_s, ddp.seeds, ddp.epoch_time) == ([1.0, 1.1, 1.2], [1234, 2234, 3234], 1.1)
    assert ddp.epoch_interval() == (1.0, 1.2, 0.75)
    assert not_separable(ddp, zero) == "not separable at 3 repeats"  # 1.0-1.2 overlaps 1.15-1.4
    zero.repeat_epoch_s = [1.25, 1.3, 1.4]
    assert ddp.separated_from(zero) and not_separable(ddp, zero) is None


@pytest.mark.units
def test_time_clauses_of_memory_findings_wait_for_separable_repeats():
    """ZeRO's "no loss in performance" compares epoch times: with overlapping intervals it is not
    judged, and the verdict rests on the memory clause alone."""
    from repro.matrix import expand, load_matrix
    from repro.report import evidence, performance
    from repro.report.collect import Result, fold_repeats

    matrix = load_matrix(rows=["ddp", "zero"])
    cells = [c for c in expand(matrix, "smoke", repeats=3) if c.gpus == 2 and c.workload == "gpt2"]
    times = {"ddp": [1.0, 1.1, 1.2], "zero": [1.5, 1.6, 1.7]}  # ZeRO 45% slower: fails the 15% clause
    state = {"ddp": 1000.0, "zero": 500.0}  # and saves 50%: within the paper's 42-66%

    def verdict(zero_times: list[float]) -> tuple[str, list[str]]:
        times["zero"] = zero_times
        results = fold_repeats([Result(c, "FINISHED", epoch_s=[times[c.row][c.repeat]] * 2,
                                       model_state_bytes=state[c.row]) for c in cells])
        return performance.zero_memory(evidence.Results(results, cores=2), {
            "saving_range": [0.42, 0.66], "from_gpus": 2, "max_time_ratio": 1.15})

    assert verdict([1.5, 1.6, 1.7])[0] == evidence.FAILS  # separated: judged, and too slow
    found, notes = verdict([1.15, 1.3, 1.4])  # overlaps DDP's 1.0-1.2
    assert found == evidence.HOLDS and "epoch-time clause not separable at 3 repeats" in notes[0]


COUNT_ONE_STEP = """
import torch
from repro.communication import CommCounter
with CommCounter().counting():
    torch.ones(4) + 1
print("counted")
"""


@pytest.mark.units
@pytest.mark.parametrize("level, printed", [(None, False), ("4", True)])
def test_the_communication_counter_keeps_kinetos_lines_out_of_the_output(level, printed):
    """Kineto prints its stages and device probing at every profile ("gpuGetDeviceCount failed with code 35"
    on a machine without a GPU, "profiler_start"): the counter silences them, unless the user set a level."""
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"} | ({"KINETO_LOG_LEVEL": level} if level else {})
    out = subprocess.run([sys.executable, "-c", COUNT_ONE_STEP], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "counted", out.stderr[-2000:]
    kineto = [line for line in out.stderr.splitlines() if "profiler_start" in line or "gpuGetDeviceCount" in line]
    assert bool(kineto) is printed, out.stderr[-2000:]
