"""The step-time model (repro.model.time), platform profiles (repro.model.platforms) and `repro calibrate`'s
keeping of a profile.

Units: profiles load and refuse a bad field in one line naming file and field; the model's terms are
the arithmetic docs/time.md writes down (topology, overlap, bubbles, epochs); the op counts are what
bench/count_ops.py counts; `repro predict --platform` prints every cell without torch. The model's error
against measured steps is held by reports/model_check.md on the main job, not here: timing on a shared
test machine is not a number a unit test can assert.
"""
from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from repro.model import costs, pipelines, platforms, time
from repro.model.flops import step_flops
from repro.model.predict import recipe_cell, row_cell
from repro.report import model_check
from repro.schema import RecipeError
from repro.shapes import parameters

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.units


def cpu_profile(**changes: object) -> platforms.Platform:
    """A profile of a made-up CPU: one thread a rank, 2 ranks, gloo; round figures so sums are exact."""
    link = platforms.Link(latency_s=1e-4, bandwidth=1e9)
    profile = platforms.Platform(
        name="test", device="cpu", ranks_per_node=2, backend="gloo",
        matmul=platforms.Matmul(peak={"fp32": 1e11}, efficiency=[[0, 0.5], [1e6, 1.0]]),
        memory=platforms.Memory(bandwidth=1e10), dispatch_s={"default": 1e-5}, dispatch_overlaps=False,
        comm_overlaps=False, collectives={"intra": {"default": link}})
    return dataclasses.replace(profile, **changes)


# a workload's own rates as `repro calibrate` keeps them (made up: round figures)
RATES = platforms.WorkloadRates(matmul=[[1e6, 2e10], [1e8, 6e10]], activation_bandwidth=4e9, state_bandwidth=1e10)


@pytest.mark.parametrize("name,per_node", [("lassen", 4), ("thetagpu", 8)])
def test_shipped_profiles_load_as_assumptions_with_sources(name, per_node):
    profile = platforms.load(name)
    assert profile.assumption and profile.sources and profile.ranks_per_node == per_node
    assert profile.link("inter", "all_reduce").bandwidth == {"lassen": 25e9, "thetagpu": 200e9}[name]
    assert profile.matmul.rate("fp16", 20e9) == {"lassen": 125e12, "thetagpu": 312e12}[name] * 0.9


@pytest.mark.parametrize("edit,field", [
    (lambda raw: raw["collectives"]["intra"]["default"].update(bandwidth=-1), "collectives.intra.default.bandwidth"),
    (lambda raw: raw["collectives"]["intra"].update(all_to_all={"latency_s": 0, "bandwidth": 1}), "collectives.intra.all_to_all"),
    (lambda raw: raw["matmul"]["peak"].update(fp32="15.7e12"), "matmul.peak"),  # YAML reads 15.7e12 as a string
    (lambda raw: raw.update(ranks_per_node=0), "ranks_per_node"),
    (lambda raw: raw.pop("dispatch_s"), "dispatch_s"),
    (lambda raw: raw.update(workloads={"gpt2": {"matmul": [[1e6]], "activation_bandwidth": 1, "state_bandwidth": 1}}),
     "workloads.gpt2.matmul"),
    (lambda raw: raw.update(workloads={"gpt2": {"matmul": [[1e6, 1e9]], "activation_bandwidth": 0, "state_bandwidth": 1}}),
     "workloads.gpt2.activation_bandwidth"),
])
def test_a_bad_profile_fails_in_one_line_naming_file_and_field(tmp_path, edit, field):
    raw = yaml.safe_load((REPO / "configs/platforms/lassen.yaml").read_text())
    edit(raw)
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RecipeError) as error:
        platforms.load(path)
    assert str(error.value).startswith(f"{path}: {field}:") and "\n" not in str(error.value)


def test_a_kept_profile_is_read_back_as_written_and_reused(tmp_path, monkeypatch):
    from repro import calibrate

    measured = cpu_profile(workloads={"gpt2": RATES, "vgg16": RATES})
    kept = calibrate.profile_path(tmp_path)
    platforms.dump(measured, kept)
    monkeypatch.setattr(calibrate, "measure_apart", lambda path: pytest.fail("a kept profile is measured again"))
    assert dataclasses.replace(calibrate.calibrated(tmp_path), path="") == measured
    assert calibrate.store_folder(f"sqlite:///{tmp_path}/mlflow.db") == tmp_path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a run's store elsewhere reuses the shared copy
    platforms.dump(measured, calibrate.profile_path(calibrate.shared_folder()))
    assert dataclasses.replace(calibrate.calibrated(tmp_path / "store", shared=True), path="") == measured


def test_a_kept_profile_without_the_workloads_own_rates_is_measured_anew(tmp_path, monkeypatch):
    from repro import calibrate

    platforms.dump(cpu_profile(), calibrate.profile_path(tmp_path))  # as kits before WorkloadRates kept it
    measured = cpu_profile(workloads={"gpt2": RATES, "vgg16": RATES})
    monkeypatch.setattr(calibrate, "measure_apart", lambda path: platforms.dump(measured, path))
    assert dataclasses.replace(calibrate.calibrated(tmp_path), path="") == measured
    assert platforms.load(calibrate.profile_path(tmp_path)).workloads == {"gpt2": RATES, "vgg16": RATES}


def measured_profile(scale: float, at: str) -> platforms.Platform:
    """cpu_profile as `repro calibrate` keeps it, its rates `scale` times and its times 1/`scale` times a base."""
    rates = platforms.WorkloadRates(matmul=[[1e6, 2e10 * scale], [1e8, 6e10 * scale]],
                                    activation_bandwidth=4e9 * scale, state_bandwidth=1e10 * scale)
    link = platforms.Link(latency_s=1e-4 / scale, bandwidth=1e9 * scale)
    return cpu_profile(
        matmul=platforms.Matmul(peak={"fp32": 1e11 * scale}, efficiency=[[1e3, 0.5], [1e6, 1.0]]),
        memory=platforms.Memory(bandwidth=1e10 * scale), dispatch_s={"default": 1.5e-5 / scale, "gpt2": 1e-5 / scale,
                                                                     "vgg16": 2e-5 / scale},
        collectives={"intra": {kind: link for kind in platforms.KINDS}}, workloads={"gpt2": rates, "vgg16": rates},
        measured={"matmul": [[1e3, 5e10 * scale], [1e6, 1e11 * scale]],
                  "collectives_s": {"all_reduce": [1e-4 / scale, 5e-3 / scale]},
                  "measurements": [{"at": at, "load_average": [0.1, 0.1, 0.1]}]})


def test_a_profile_measured_several_times_keeps_each_figure_at_its_fastest(tmp_path):
    """calibrate.fastest: GPT-2's dispatch from one measurement and VGG-16's from another, every rate at its
    highest, every time at its least; the kept file records when each measurement was made."""
    from repro import calibrate

    slow, fast = measured_profile(1.0, "01:00"), measured_profile(2.0, "01:05")
    mixed = dataclasses.replace(fast, dispatch_s={"default": 1.2e-5, "gpt2": 2e-5, "vgg16": 4e-6})
    folded = calibrate.fastest([slow, mixed])
    assert folded.dispatch_s == {"default": pytest.approx(7e-6), "gpt2": 1e-5, "vgg16": 4e-6}
    assert folded.matmul.peak == {"fp32": 2e11} and folded.matmul.efficiency == [[1e3, 0.5], [1e6, 1.0]]
    assert folded.memory.bandwidth == 2e10
    assert folded.workloads["gpt2"] == platforms.WorkloadRates([[1e6, 4e10], [1e8, 1.2e11]], 8e9, 2e10)
    assert folded.collectives["intra"]["all_reduce"] == platforms.Link(latency_s=5e-5, bandwidth=2e9)
    assert folded.measured["collectives_s"] == {"all_reduce": [5e-5, 2.5e-3]}
    path = tmp_path / "platform.yaml"
    platforms.dump(folded, path)
    again = platforms.load(path)
    refolded = calibrate.fastest([again, slow])
    assert [m["at"] for m in refolded.measured["measurements"]] == ["01:00", "01:05", "01:00"]
    assert dataclasses.replace(refolded, path="") == dataclasses.replace(again, path="", measured={
        **again.measured, "measurements": [*again.measured["measurements"], *slow.measured["measurements"]]})


def test_matmul_rate_is_the_share_of_the_largest_threshold_at_or_below_the_size():
    matmul = platforms.load("thetagpu").matmul
    assert [matmul.rate("bf16", size) for size in (1e8, 1e9, 15.9e9, 200e9)] == [312e12 * s for s in (0.1, 0.6, 0.6, 0.95)]
    assert matmul.rate("fp8", 1e9) == 19.5e12 * 0.6  # a precision the profile does not list: fp32's


def test_a_group_across_nodes_shares_the_nodes_network_between_the_groups_that_run_at_once():
    lassen = platforms.load("lassen")
    inter = lassen.link("inter", "all_reduce")
    payload, wire = 2**30, costs.wire_bytes("all_reduce", 2**30, 16)
    whole = time.collective_seconds(lassen, "all_reduce", payload, 16)  # DDP over 4 nodes: 4 ranks a node
    assert whole == pytest.approx(inter.latency_s + wire / (25e9 * 0.9))
    one_a_node = time.collective_seconds(lassen, "all_reduce", payload, 16, per_node=1)  # the hybrid's dp at tp=4
    assert one_a_node == pytest.approx(inter.latency_s + 4 * wire / (25e9 * 0.9))
    inside = time.collective_seconds(lassen, "all_reduce", payload, 4)
    assert inside == pytest.approx(10e-6 + costs.wire_bytes("all_reduce", payload, 4) / (64e9 * 0.6))
    assert time.collective_seconds(lassen, "all_reduce", payload, 1) == 0.0


def test_megatron_hybrid_sends_its_tp_volume_inside_a_node_and_its_dp_volume_across():
    thetagpu = platforms.load("thetagpu")
    hybrid = recipe_cell("gpt2", "megatron", 64, sets=["megatron.tp=8"])
    within, across = costs.megatron_reduced(hybrid)
    step = time.step_time(hybrid, thetagpu)
    calls = 4 * 24 + 2 + 2 * hybrid.recomputed  # f and g of each layer, the embedding's and the head's; again where recomputed
    tp_comm = time.collective_seconds(thetagpu, "all_reduce", within, 8, calls)
    dp_comm = time.collective_seconds(thetagpu, "all_reduce", across, 8, per_node=1)
    assert step.comm_s == pytest.approx(tp_comm + dp_comm)
    assert step.exposed_s >= tp_comm  # the tp all-reduces sit on the critical path
    intra = thetagpu.link("intra", "all_reduce")
    assert tp_comm == pytest.approx(calls * intra.latency_s + costs.wire_bytes("all_reduce", within, 8) / (300e9 * 0.6))


def test_ddp_hides_its_all_reduce_behind_backward_but_the_last_bucket_where_the_platform_overlaps():
    cell = recipe_cell("gpt2", "ddp", 2, "smoke")
    cpu = cpu_profile()
    step = time.step_time(cell, cpu)
    assert step.exposed_s == step.comm_s > 0  # gloo on a CPU whose cores run the ranks: nothing hidden
    overlapping = time.step_time(cell, dataclasses.replace(cpu, comm_overlaps=True))
    bucket = min(4 * 220_544, time.DDP_BUCKET)
    assert overlapping.exposed_s == pytest.approx(time.collective_seconds(cpu, "all_reduce", bucket, 2))


def test_fsdp_pays_a_latency_for_every_collective_it_issues_as_counted():
    """FSDP2 at 2 processes issues, as the kit's counter counted (docs/measurement.md, "Where an FSDP2 step's
    time goes"): GPT-2 smoke 10 all-gathers (5 units, twice) and 214 all-reduces (5 units' gradients and
    Lamb's 209 norm reductions), VGG-16 smoke 16 and 8 (8 units, Adam: no sharded norm); each costs the
    profile's latency, and what a step hands is the cost model's bytes."""
    gpt2, vgg16 = (recipe_cell(workload, "fsdp", 2, "smoke") for workload in ("gpt2", "vgg16"))
    assert time.sharded_calls(gpt2) == (5, 10, 209) and time.sharded_calls(vgg16) == (8, 16, 0)
    cpu = cpu_profile()
    step, comm = time.step_time(gpt2, cpu), costs.predict(gpt2).comm
    wire = costs.wire_bytes("all_gather", comm["all_gather"], 2) + costs.wire_bytes("all_reduce", comm["all_reduce"], 2)
    assert step.comm_s == pytest.approx((10 + 214) * 1e-4 + wire / 1e9)
    grad_op = dataclasses.replace(gpt2, options={**gpt2.options, "sharding": "grad-op"})
    assert time.sharded_calls(grad_op) == (5, 5, 209)


def test_zero_reduces_its_gradients_as_deepspeed_packs_them_each_flush_a_call():
    """ZeRO-2 on GPT-2 smoke's 20,000-element bucket flushes when the next gradient (backward's order) would
    overflow it: 1, 4, 14 and 27 all-reduces a pass at d_model 8, 32, 64 and 128 (at 128 tensors outgrow the
    bucket and go alone, one of them cut in two at the ranks' partition edge), every gradient element once;
    stage 1 packs the parameters' own order. Each flush pays the link's latency, as do the gradient norm's
    all-reduce and the partitions' all-gather (tests/test_costmodel.py holds the counts to DeepSpeed's)."""
    cell = recipe_cell("gpt2", "zero", 2, "smoke")
    sized = {d: dataclasses.replace(cell, shape=dataclasses.replace(cell.shape, d_model=d)) for d in (8, 32, 64, 128)}
    assert [len(time.zero_reductions(c)) for c in sized.values()] == [1, 4, 14, 27]
    assert all(sum(time.zero_reductions(c)) == parameters(c.shape) for c in sized.values())
    assert time.partition_pieces(start=90, numel=30, partition=100) == [10, 20]
    comm = costs.predict(cell).comm
    wire = costs.wire_bytes("all_reduce", comm["all_reduce"], 2) + costs.wire_bytes("all_gather", comm["all_gather"], 2)
    assert time.step_time(cell, cpu_profile()).comm_s == pytest.approx((14 + 2) * 1e-4 + wire / 1e9)
    stage1 = dataclasses.replace(cell, options={**cell.options, "stage": 1})
    micro = dataclasses.replace(cell, micro_batch=cell.batch_per_gpu // 2)
    assert (time.zero_flushes(stage1), time.zero_flushes(micro)) == (len(time.zero_reductions(stage1)), 2 * 14)


def test_compute_is_flops_at_the_rate_plus_memory_plus_dispatch_on_a_cpu():
    cell = recipe_cell("gpt2", "ddp", 1, "smoke")
    flops, prediction = step_flops(cell), costs.predict(cell)
    cpu = cpu_profile()
    ops = (4 + 4 * 32 + 10) + (7 + 4 * 68 + 16) + 21 * 52 + 11  # bench/count_ops.py: forward, backward, LAMB
    size = flops.forward / (4 * 6 + 1)
    expected = ((flops.forward + flops.backward) / cpu.matmul.rate("fp32", size)
                + (2 * prediction.activations + 3 * prediction.model_state) / 1e10 + ops * 1e-5)
    assert time.step_time(cell, cpu).total_s == pytest.approx(expected)
    gpu_like = dataclasses.replace(cpu, dispatch_overlaps=True)
    assert time.step_time(cell, gpu_like).total_s == pytest.approx(max(expected - ops * 1e-5, ops * 1e-5))


def test_every_micro_batch_writes_and_reads_its_own_activations():
    """Under gradient accumulation each pass saves one micro-batch's activations (the cost model's peak) and
    reads them back: the memory-bound bytes of a step are the passes times that, not one pass's."""
    whole = recipe_cell("gpt2", "ddp", 1, "smoke")
    micro = dataclasses.replace(whole, micro_batch=whole.batch_per_gpu // 4)
    cpu, free = cpu_profile(), cpu_profile(memory=platforms.Memory(bandwidth=1e30))
    memory = time.step_time(micro, cpu).total_s - time.step_time(micro, free).total_s
    prediction = costs.predict(micro)
    assert memory == pytest.approx((4 * 2 * prediction.activations + 3 * prediction.model_state) / 1e10)


@pytest.mark.parametrize("workload", ["gpt2", "vgg16"])
def test_calibrate_times_a_workloads_own_operations_on_either_side_of_the_smoke_size(workload):
    """The sizes are the model's mean matrix operation of each calibration shape (so the model reads the
    rate at the size it computes); the smoke recipe's, which the main job checks, lies between, unmeasured.
    The smallest shape at half the batch is the size of torch-1f1b's two micro-batches on one rank there,
    below the width sweep: the model reads the rate of the own-time run at that shape, never the nearest's."""
    from repro import calibrate
    from repro.recipe import load_file, recipe_path

    def mean_size(sets: list[str]) -> float:
        cell = costs.cell_of(load_file(recipe_path(workload, "smoke"), sets))
        return time.mean_matmul_flops(cell, step_flops(cell), time.all_layers(cell), 1)

    rates = calibrate.workload_rates(workload)
    smallest = calibrate.CALIBRATION[workload][0]
    sizes = [mean_size(sets) for sets in calibrate.CALIBRATION[workload]]
    split = mean_size([*smallest, f"train.batch_per_gpu={calibrate.recipe_batch(workload) // calibrate.SPLIT}"])
    assert [size for size, _ in rates.matmul] == [split, *sizes] and sizes[0] < mean_size([]) < sizes[1]
    one_rank = costs.cell_of(load_file(recipe_path(workload, "smoke"), ["run.framework=torch-pipeline", *smallest]))
    assert pipelines.schedule_microbatches(one_rank) == calibrate.SPLIT
    assert time.mean_matmul_flops(one_rank, step_flops(one_rank), time.all_layers(one_rank), calibrate.SPLIT) == split
    assert all(rate > 0 for _, rate in rates.matmul) and rates.activation_bandwidth > 0 and rates.state_bandwidth > 0


def test_the_half_batch_run_adds_a_rate_and_no_vote_to_the_bandwidths(monkeypatch):
    """Its optimizer step is the smallest size's again, where the other operations take barely more than their
    cost at the negligible size: a bandwidth of noise, which as a fourth vote moved the median (VGG-16's state
    bandwidth kept at 322 GB/s against 13). Timings stand in here: the half-batch run's beyond-dispatch time is nil."""
    import statistics
    from types import SimpleNamespace

    from repro import calibrate
    from repro.recipe import load_file, recipe_path

    runs = []

    def timed(passes, update, rounds=3):
        runs.append(None)
        other = 0.001 if len(runs) <= 2 else 0.001 * len(runs)  # the negligible size and the half batch: 1 us an op
        return tuple(SimpleNamespace(seconds={"matrix": 0.01, "other": other}, ops={"matrix": 10, "other": 1000})
                     for _ in range(2))

    monkeypatch.setattr(calibrate, "timed_phases", timed)
    rates = calibrate.workload_rates("vgg16")
    beyond = [0.002, 0.003, 0.004]  # the three sizes (runs 3 to 5): their other seconds less 1000 ops at 1 us
    states = [costs.predict(costs.cell_of(load_file(recipe_path("vgg16", "smoke"), sets))).model_state
              for sets in calibrate.CALIBRATION["vgg16"]]
    assert len(rates.matmul) == 4 and len(runs) == 5
    assert rates.state_bandwidth == pytest.approx(statistics.median(time.OPTIMIZER_TRAFFIC * s / b for s, b in zip(states, beyond)))


def test_a_workloads_own_rates_stand_in_for_the_generic_ones_in_fp32():
    cell = recipe_cell("gpt2", "ddp", 1, "smoke")
    flops, prediction = step_flops(cell), costs.predict(cell)
    size = flops.forward / (4 * 6 + 1)
    assert 1e6 < size < 1e8  # between RATES' two sizes: the rate is log-linear between them
    rate = 2e10 + math.log(size / 1e6) / math.log(100) * 4e10
    ops = (4 + 4 * 32 + 10) + (7 + 4 * 68 + 16) + 21 * 52 + 11
    expected = ((flops.forward + flops.backward) / rate + 2 * prediction.activations / 4e9
                + 3 * prediction.model_state / 1e10 + ops * 1e-5)
    measured = cpu_profile(workloads={"gpt2": RATES})
    assert time.step_time(cell, measured).total_s == pytest.approx(expected)
    assert RATES.matmul_rate(1) == 2e10 and RATES.matmul_rate(1e12) == 6e10  # the nearest size outside them
    bf16 = dataclasses.replace(cell, precision="bf16")  # timed in fp32 only: the generic figures
    assert time.step_time(bf16, measured) == time.step_time(bf16, cpu_profile())


def test_a_pipelines_bubble_is_every_other_ranks_micro_batch_slot_once():
    thetagpu = platforms.load("thetagpu")
    cell = row_cell("gpt2", "torch-1f1b", 8)
    step = time.step_time(cell, thetagpu)
    schedule, _, micro, samples, sizes = time.pipeline_plan(cell)
    assert micro == 32 * 8 // 4  # the recipe's train.micro_batch of 4 sequences: the global batch of 32 x 8 in 64
    computes = time.rank_computes(cell, thetagpu, sizes, micro, samples)
    assert step.compute_s == max(computes) == computes[-1]  # the last stage's head and loss make it the busiest
    assert step.bubble_s == pytest.approx((sum(computes) - computes[-1]) / micro)
    # the other ranks are lighter, so the fill and drain are shorter than 7 of the busiest rank's slots
    assert step.bubble_s < 0.5 * step.compute_s * (8 - 1) / micro
    interleaved = dataclasses.replace(cell, options={**cell.options, "schedule": "interleaved-1f1b"})
    assert time.pipeline_plan(interleaved)[1] == 2
    looped = time.step_time(interleaved, thetagpu)
    _, _, micro, samples, sizes = time.pipeline_plan(interleaved)
    computes = time.rank_computes(interleaved, thetagpu, sizes, micro, samples)
    assert looped.bubble_s == pytest.approx((sum(computes) - max(computes)) / 2 / micro)
    assert time.step_time(row_cell("gpt2", "pipedream", 8), thetagpu).bubble_s == 0.0


def test_a_pipeline_stage_moves_each_micro_batch_once_and_its_live_state_not_what_it_holds():
    pipedream = row_cell("vgg16", "pipedream", 2, "smoke")
    sizes = time.pipeline_plan(pipedream)[4]
    saved, state = pipelines.rank_traffic(pipedream, sizes, 0, 2, 1, pipedream.batch_per_gpu)
    held = costs.predict(pipedream)  # stage 0's peak: 2 mini-batches in flight, 2 stashed weight versions
    assert held.activations == 2 * saved
    elements = pipelines.rank_shares(pipedream, sizes, 2)[0][0]
    assert held.model_state - state == costs.FP32 * elements  # the live weights and one copy a step, not two versions
    one_f_one_b = row_cell("vgg16", "torch-1f1b", 1, "smoke")  # 2 micro-batches of 8, 1 held at a time
    _, _, micro, samples, sizes = time.pipeline_plan(one_f_one_b)
    saved = pipelines.rank_traffic(one_f_one_b, sizes, 0, 1, micro, samples)[0]
    assert (micro, samples) == (2, 8) and saved == 2 * one_f_one_b.shape.stage_activation_bytes(0, 40, 8)


def test_torchgpipe_on_cpu_stand_ins_runs_every_partition_on_one_host_without_a_bubble():
    cell = row_cell("vgg16", "torchgpipe", 2, "smoke")
    step = time.step_time(cell, cpu_profile())
    assert step.bubble_s == 0.0 and step.comm_s == 0.0
    one = time.step_time(dataclasses.replace(cell, gpus=1, options={**cell.options, "chunks_per_gpu": 8}), cpu_profile())
    assert step.total_s == pytest.approx(one.total_s)  # the same 8 micro-batches through the same layers


@pytest.mark.parametrize("workload", ["gpt2", "vgg16"])
def test_torchgpipe_on_cpu_moves_each_micro_batchs_activations_once(workload):
    """One host runs every partition over every micro-batch: each micro-batch's saved activations are written
    and read once (pipelines.rank_traffic, as for the other pipelines). The cost model's GPipe peak holds every
    micro-batch at once, so the passes times it counted GPT-2's 16 micro-batches at 4 partitions 16 times over."""
    cpu, free = cpu_profile(), cpu_profile(memory=platforms.Memory(bandwidth=1e30))
    activations = {}
    for gpus in (1, 2, 4):
        cell = row_cell(workload, "torchgpipe", gpus, "smoke")
        _, _, micro, samples, sizes = time.pipeline_plan(cell)
        traffic = [pipelines.rank_traffic(cell, sizes, rank, gpus, micro, samples) for rank in range(gpus)]
        state = sum(held for _, held in traffic)
        moved = (time.step_time(cell, cpu).total_s - time.step_time(cell, free).total_s) * 1e10
        activations[gpus] = moved - 3 * state
        assert activations[gpus] == pytest.approx(2 * sum(saved for saved, _ in traffic))
    if workload == "gpt2":  # 4 partitions, 16 micro-batches of 8 sequences; 1 partition, 4 of 8
        assert activations[4] == pytest.approx(4 * activations[1])


def test_an_epoch_is_its_steps_times_the_step():
    cell = row_cell("vgg16", "ddp", 8)
    assert time.epoch_steps(cell, "imagenet") == math.ceil(1_281_167 / (64 * 8))
    gpt2 = row_cell("gpt2", "pipedream", 8)
    assert time.epoch_steps(gpt2, "wikitext-103") == math.ceil(103_227_021 // 1024 / 32)
    assert time.epoch_steps(cell, "digits") is None


def test_predict_platform_prints_every_cell_and_the_splits_without_torch():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "repro.cli", "predict", "--platform", "lassen"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    assert "torch" not in {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    lines = out.stdout.splitlines()
    from repro.model.predict import matrix_times

    rows = matrix_times("gpt2", platforms.load("lassen"))
    for entry in rows:
        step = entry["step"]
        assert (f"  {entry['row']:<16}{entry['gpus']:>5}{step.total_s:>9.3f}{step.compute_s:>9.3f}{step.exposed_s:>9.3f}"
                f"{step.bubble_s:>9.3f}{entry['epoch_steps']:>9}{entry['epoch_s']:>9.0f}") in lines
    assert sum(line.startswith("  megatron at ") for line in lines) == 4  # 8, 16, 32 and 64 GPUs


def test_predict_refuses_a_missing_profile_in_one_line():
    out = subprocess.run([sys.executable, "-m", "repro.cli", "predict", "--platform", "nowhere.yaml"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr == "repro: nowhere.yaml: no such profile; shipped: lassen, thetagpu, or a file\n"


def test_step_time_rows_hold_each_cell_to_the_bound_and_the_median_to_its_own():
    rows = [model_check.step_time_row(measured, 0.1) for measured in (0.1, 0.125, 0.08)]
    assert [row["within"] for row in rows] == [True, True, False]  # errors 0, 0.2 (the bound itself), 0.25
    assert rows[2]["error"] == pytest.approx(0.25)  # |0.08 - 0.1| / 0.08: relative to the measured step
    checked = [{"cell": "gpt2 ddp 1g", "row": "ddp", "run_id": "r", "rows": rows}]
    assert model_check.median_step_time_error(checked) == pytest.approx(0.2)
    assert "median error 20.0% over 3 cells, 2 within 20%: **does not hold**" in model_check.markdown(checked)
    checked[0]["rows"] = rows[:1] * 2 + rows[2:]  # median 0, but one cell outside its bound
    assert "median error 0.0% over 3 cells, 2 within 20%: **does not hold**" in model_check.markdown(checked)
    checked[0]["rows"] = rows[:2]
    assert "median error 10.0% over 2 cells, 2 within 20%: holds" in model_check.markdown(checked)


def test_a_single_runs_check_says_when_the_profile_holds_no_own_time_of_its_framework(monkeypatch):
    """`repro run`'s one line: against a profile without the framework's own time (a machine-only profile, or
    settings the matrix does not run) it says the model's terms alone were checked, and where to measure the rest."""
    from repro import calibrate
    from repro.recipe import load_file, recipe_path
    from repro.report import collect

    recipe = load_file(recipe_path("gpt2", "smoke"), ["run.framework=ddp", "run.gpus=1", "run.device=cpu"])
    cell = costs.cell_of(recipe)
    measured = time.model_terms(cell, cpu_profile()).total_s * 1.1  # 10% above the terms
    result = lambda cells, *args: [collect.Result(cells[0], "FINISHED", epoch_s=[1.0], step_s={"framework_median": [measured]})]
    monkeypatch.setattr(collect, "collect", result)
    monkeypatch.setattr(model_check, "log_step_times", lambda uri, checked: None)
    for frameworks, note in (({}, True), ({time.framework_key(cell): [[0.0, 0.0], [1e9, 0.0]]}, False)):
        profile = cpu_profile(frameworks=frameworks, path="/kept/platform-test.yaml")
        monkeypatch.setattr(calibrate, "calibrated", lambda folder, shared: profile)
        line = model_check.check_run(recipe, "sqlite:///unused.db", "repro")
        assert line.startswith("step-time check: measured ") and "(error 9.1%, bound 20%; repro/model/time.py)" in line
        assert line.endswith("; the model's terms only: /kept/platform-test.yaml holds no own time of ddp at 1 process "
                             "with these settings (`repro calibrate` measures the matrix's cells)") == note


def test_the_op_counts_are_what_a_step_dispatches():
    pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "bench"))
    from count_ops import step_ops

    for layers in (2, 4):
        counted = step_ops("gpt2", [f"model.n_layer={layers}"])
        forward, backward, _ = time.layer_ops(recipe_cell("gpt2", "ddp", 1, "smoke", [f"model.n_layer={layers}"]).shape,
                                              range(layers + 2))
        per_tensor, fixed = time.OPTIMIZER_OPS["lamb"]
        assert (counted["forward"], counted["backward"], counted["optimizer"]) == (forward, backward, per_tensor * counted["tensors"] + fixed)
    vgg = step_ops("vgg16")
    per_tensor, fixed = time.OPTIMIZER_OPS["adam"]
    assert (vgg["forward"], vgg["backward"], vgg["optimizer"]) == (*time.VGG16_OPS, per_tensor * vgg["tensors"] + fixed)


def test_a_cells_check_gains_a_step_time_row_only_where_its_processes_fit_the_cores():
    from repro.cell import Cell as MatrixCell
    from repro.recipe import load_file, recipe_path
    from repro.report.collect import Result

    def result(gpus: int) -> Result:
        recipe = load_file(recipe_path("gpt2", "smoke"), ["run.framework=ddp", f"run.gpus={gpus}"])
        return Result(MatrixCell("gpt2", "ddp", "ddp", gpus, recipe), "FINISHED", run_id="r", epoch_s=[1.0],
                      step_s={"median": [0.05, 0.07, 0.06], "framework_median": [0.045, 0.065, 0.055]})

    two = model_check.check(result(2), cpu_profile(), cores=2)
    row = next(row for row in two["rows"] if row["quantity"] == "step_time")
    modelled = time.step_time(costs.cell_of(result(2).cell.recipe), cpu_profile()).total_s
    assert (row["measured"], row["modelled"]) == (0.055, modelled)  # the median of the epochs' framework medians
    four = model_check.check(result(4), cpu_profile(), cores=2)
    assert all(row["quantity"] != "step_time" for row in four["rows"])  # 4 processes on 2 cores: contention


def test_a_frameworks_own_time_is_read_on_the_line_through_its_two_measured_sizes_for_its_settings_alone():
    """Platform.frameworks (repro.framework_overhead): ZeRO-2's own time measured 2 ms at 4 bucket flushes a step
    and 6 ms at 24, so 4 ms at the smoke cell's 14 and 8 ms at 34 (its own time follows its flushes); added to
    the model's terms for the cell whose framework, process count and settings the key names, and to no other
    (ZeRO-3 is another key than ZeRO-2). DDP's, and ZeRO's at one process, are read at the model state a rank."""
    cell = recipe_cell("gpt2", "zero", 2, "smoke")
    key, where = time.framework_key(cell), time.own_time_scale(cell)
    assert where == time.zero_flushes(cell) == 14
    measured = cpu_profile(frameworks={key: [[4, 0.002], [24, 0.006]]})
    assert measured.framework_seconds(key, where) == pytest.approx(0.004)
    assert measured.framework_seconds(key, where + 20) == pytest.approx(0.008)
    assert measured.framework_seconds("gpt2 zero 4g 0000000000", where) == 0.0
    terms, step = time.model_terms(cell, measured), time.step_time(cell, measured)
    assert step.framework_s == pytest.approx(0.004) and step.total_s == pytest.approx(terms.total_s + 0.004)
    assert time.step_time(cell, cpu_profile()) == terms  # a profile without frameworks: the terms alone
    stage3 = dataclasses.replace(cell, options={**cell.options, "stage": 3})
    assert time.framework_key(stage3) != key and time.step_time(stage3, measured).framework_s == 0.0
    assert time.own_time_scale(stage3) == costs.predict(stage3).model_state
    smaller = recipe_cell("gpt2", "zero", 2, "smoke", ["model.d_model=32", "model.n_head=2"])
    assert time.framework_key(smaller) == key  # the size is not in the key: it is where the line is read
    one = recipe_cell("gpt2", "zero", 1, "smoke")  # no peer to wait for: DeepSpeed's host work, by model state
    ddp = recipe_cell("gpt2", "ddp", 2, "smoke")
    assert all(time.own_time_scale(c) == costs.predict(c).model_state for c in (one, ddp))


def test_a_profile_refuses_a_malformed_frameworks_entry_naming_it(tmp_path):
    raw = yaml.safe_load((REPO / "configs" / "platforms" / "lassen.yaml").read_text())
    raw["frameworks"] = {"gpt2 ddp 1g abc": [[1e6]]}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(RecipeError, match=r"frameworks\.gpt2 ddp 1g abc: expected \[\[where >= 0, seconds\]"):
        platforms.load(tmp_path / "p.yaml")
