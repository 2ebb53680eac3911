"""`repro calibrate`: measure this machine and write its platform profile (repro.model.platforms), the
figures the step-time model (repro.model.time) reads. In well under a minute, one thread a process as
the CPU stand-ins train (repro.loop):

- matrix multiplies of square matrices from 16 to 512 (FLOPs 2 n^3 each): the rate by operation size;
- a copy of 64 MiB: the bandwidth of memory-bound operations (bytes read and written);
- the host's cost of one dispatched operation, per workload: its training step at a size whose FLOPs
  are negligible (TINY), timed, over the aten operations the step dispatches (TorchDispatchMode);
- per workload, its own operations in its fp32 step at sizes either side of the smoke recipe's, each
  timed on its own: the matrix rate at the step's mean matrix operation, and the bandwidth its other
  operations reach over the bytes the model counts for them (WorkloadRates);
- per collective kind, 2 gloo processes: the time of 4 bytes (latency) and of 4 MiB (bandwidth on the
  wire, repro.model.costs.wire_bytes).

A profile made here is kept (`profile_path`) and reused while the CPU model is the same.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from repro.hardware import cpu_model
from repro.model import costs, platforms

if TYPE_CHECKING:  # torch is imported where a measurement needs it: reading a kept profile needs none
    import torch

SIZES = (16, 32, 64, 128, 256, 512)
COPY_BYTES = 64 * 2**20
LARGE = 4 * 2**20
KINDS = ("all_reduce", "all_gather", "broadcast", "send")


def best_seconds(work: Callable[[], Any], repeat: int, rounds: int = 3) -> float:
    """The fastest of `rounds` timings of `repeat` calls, per call (the least disturbed by other load)."""
    work()
    timings = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeat):
            work()
        timings.append((time.perf_counter() - start) / repeat)
    return min(timings)


def matmul_points() -> list[list[float]]:
    """[flops of one multiply, FLOP/s] for each of SIZES."""
    import torch

    points = []
    for n in SIZES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        seconds = best_seconds(lambda: torch.mm(a, b), max(1, int(2e7 / n**3)))
        points.append([2.0 * n**3, 2.0 * n**3 / seconds])
    return points


def memory_bandwidth() -> float:
    import torch

    source, target = torch.empty(COPY_BYTES // 4), torch.empty(COPY_BYTES // 4)
    return 2 * COPY_BYTES / best_seconds(lambda: target.copy_(source), 4)


def sample_batch(workload: str, recipe: Any, samples: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`samples` random samples of `recipe`'s workload: token ids and next tokens, or images and classes."""
    import torch

    from repro.shapes import shape_of

    shape = shape_of(workload, recipe.model, recipe.data.dataset)
    if workload == "gpt2":
        return (torch.randint(0, shape.vocab, (samples, shape.seq_len)),
                torch.randint(0, shape.vocab, (samples, shape.seq_len)))
    return torch.randn(samples, 3, shape.image_size, shape.image_size), torch.randint(0, shape.classes, (samples,))


# each workload at a size whose FLOPs are negligible, so a step's time is its operations' dispatch
TINY = {"gpt2": ["model.d_model=8", "model.n_head=2", "model.seq_len=4"],
        "vgg16": ["model.width_div=64", "model.classifier_width=8"]}
# the sizes a workload's own operations are timed at (WorkloadRates): either side of the smoke recipe's
# (GPT-2 d_model 64, VGG-16 width_div 8), none of them a size the main job checks the model on
CALIBRATION = {"gpt2": [["model.d_model=32", "model.n_head=2"], ["model.d_model=128", "model.n_head=8"],
                        ["model.d_model=256", "model.n_head=8"]],
               "vgg16": [["model.width_div=16"], ["model.width_div=4"], ["model.width_div=2"]]}
# the smallest size is timed again at 1/SPLIT of the recipe's batch, for its matrix rate: torch's schedules split a step
# into micro-batches whose operations (1.4-1.8 MFLOP at that size) lie below the width sweep's smallest (2.7-3.0), where
# the rate was read at the nearest measured size: 21.6 GFLOP/s for VGG-16 against 13.7 at half its batch (docs/time.md).
# Not for the bandwidths: that run's optimizer step is the smallest size's again, where the other operations take
# barely more than their dispatch cost, so their bandwidth is noise (up to 4.8e6 GB/s on a 2-core Xeon), and as a
# fourth vote it moved the median (VGG-16's state bandwidth kept at 322 GB/s against 13)
SPLIT = 2
# aten operations the model times as matrix work (repro.model.time: GPT2_MATMULS, VGG-16's layers)
MATRIX_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "scaled_dot_product")


def training_step(workload: str, sets: list[str], samples: int = 1) -> tuple[Any, Callable[[], None], Callable[[], None]]:
    """The smoke recipe of `workload` with `sets`, one process, plain PyTorch: (recipe, forward with its
    loss and backward, the optimizer's step)."""
    import torch

    from repro import registry
    from repro.optim import make_optimizer
    from repro.recipe import load_file, recipe_path

    recipe = load_file(recipe_path(workload, "smoke"), ["run.framework=ddp", "run.gpus=1", *sets])
    model = registry.workload_class(workload)(recipe.model, recipe.data, Path(".")).build_model()
    optimizer = make_optimizer(recipe.train.optimizer, model.parameters())
    inputs, targets = sample_batch(workload, recipe, samples)

    def passes() -> None:
        output = model(inputs)
        torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1)).backward()

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad()

    return recipe, passes, update


def op_timer() -> Any:
    """A TorchDispatchMode that counts the aten operations run under it and times each one, matrix
    operations (MATRIX_OPS) apart from the rest."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpTimer(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seconds = {"matrix": 0.0, "other": 0.0}
            self.ops = {"matrix": 0, "other": 0}

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kind = "matrix" if any(name in func.__name__.split(".")[0] for name in MATRIX_OPS) else "other"
            start = time.perf_counter()
            result = func(*args, **(kwargs or {}))
            self.seconds[kind] += time.perf_counter() - start
            self.ops[kind] += 1
            return result

    return OpTimer()


def timed_phases(passes: Callable[[], None], update: Callable[[], None], rounds: int = 3) -> tuple[Any, Any]:
    """Op timers of the passes and of the optimizer step: the round of least time of `rounds`, after one
    untimed (the optimizer's state is created on its first step)."""
    passes()
    update()
    best = None
    for _ in range(rounds):
        timers = op_timer(), op_timer()
        with timers[0]:
            passes()
        with timers[1]:
            update()
        if best is None or sum(sum(t.seconds.values()) for t in timers) < sum(sum(t.seconds.values()) for t in best):
            best = timers
    return best


def dispatch_seconds(workload: str) -> float:
    """Seconds per aten operation of `workload`'s training step (forward, loss, backward, optimizer) at
    a negligible size (TINY): its step's time over the operations it dispatches."""
    _, passes, update = training_step(workload, TINY[workload])
    timers = timed_phases(passes, update, rounds=1)
    ops = sum(sum(t.ops.values()) for t in timers)
    return best_seconds(lambda: (passes(), update()), 10) / ops


def workload_rates(workload: str) -> platforms.WorkloadRates:
    """The workload's own operations timed at CALIBRATION's sizes, the smallest also at 1/SPLIT of the recipe's
    batch: the matrix rate at each one's mean matrix operation; at CALIBRATION's sizes, the bytes the model counts
    for memory-bound work (2 x activations, 3 x model state) over the seconds the other operations take beyond
    their cost at TINY's negligible size (which the dispatch term counts), in the passes and in the optimizer
    step (the median of the sizes)."""
    from repro.model.flops import step_flops
    from repro.model.time import OPTIMIZER_TRAFFIC, all_layers, mean_matmul_flops

    tiny = timed_phases(*training_step(workload, TINY[workload])[1:])
    base = sum(t.seconds["other"] for t in tiny) / sum(t.ops["other"] for t in tiny)
    batch = recipe_batch(workload)
    matmul, activation, state = [], [], []
    for sets, samples in [(CALIBRATION[workload][0], batch // SPLIT), *((sets, batch) for sets in CALIBRATION[workload])]:
        recipe, passes, update = training_step(workload, [*sets, f"train.batch_per_gpu={samples}"], samples)
        timers = timed_phases(passes, update)
        cell = costs.cell_of(recipe)
        flops, prediction = step_flops(cell), costs.predict(cell)
        matmul.append([mean_matmul_flops(cell, flops, all_layers(cell), 1), flops.counted / timers[0].seconds["matrix"]])
        if samples < batch:  # a matrix rate only (SPLIT)
            continue
        beyond = [max(t.seconds["other"] - t.ops["other"] * base, 1e-9) for t in timers]
        activation.append(2 * prediction.activations / beyond[0])
        state.append(OPTIMIZER_TRAFFIC * prediction.model_state / beyond[1])
    return platforms.WorkloadRates(matmul=matmul, activation_bandwidth=statistics.median(activation),
                                   state_bandwidth=statistics.median(state))


def recipe_batch(workload: str) -> int:
    """Samples a step of the workload's smoke recipe on one process."""
    from repro.recipe import load_file, recipe_path

    return load_file(recipe_path(workload, "smoke"), []).train.batch_per_gpu


def dispatch_table() -> dict[str, float]:
    """dispatch_seconds of every workload, and their mean as the default for others."""
    table = {name: dispatch_seconds(name) for name in TINY}
    return {"default": statistics.fmean(table.values()), **table}


def collective_worker(rank: int, port: int, queue: Any) -> None:
    """One of 2 gloo processes: per kind, the median time of 4 bytes and of LARGE bytes (rank 0 reports)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = {}
    for kind in KINDS:
        timings = []
        for size in (4, LARGE):
            tensor = torch.zeros(size // 4)
            gathered = [torch.zeros(size // 4) for _ in range(2)]
            run = {"all_reduce": lambda: dist.all_reduce(tensor), "broadcast": lambda: dist.broadcast(tensor, 0),
                   "all_gather": lambda: dist.all_gather(gathered, tensor),
                   "send": lambda: dist.send(tensor, 1) if rank == 0 else dist.recv(tensor, 0)}[kind]
            samples = []
            for _ in range(12 if size == LARGE else 60):
                dist.barrier()
                start = time.perf_counter()
                run()
                samples.append(time.perf_counter() - start)
            timings.append(statistics.median(samples[2:]))
        out[kind] = timings
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def collective_links() -> tuple[dict[str, Any], dict[str, Any]]:
    """Each kind's Link from 2 gloo processes on this machine, and the raw timings."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=collective_worker, args=(rank, port, queue)) for rank in range(2)]
    for process in processes:
        process.start()
    timings = queue.get(timeout=120)
    for process in processes:
        process.join()
    links = {}
    for kind, (small, large) in timings.items():
        wire = costs.wire_bytes(kind, LARGE, 2)
        links[kind] = platforms.Link(latency_s=small, bandwidth=wire / max(large - small, 1e-9))
    links["recv"] = links["send"]
    links["reduce_scatter"] = links["all_reduce"]  # gloo has none: the kit runs it as an all-reduce
    return links, timings


def measure() -> platforms.Platform:
    """This machine's profile, measured now."""
    import torch

    torch.set_num_threads(1)
    points = matmul_points()
    peak = max(rate for _, rate in points)
    links, timings = collective_links()
    device = cpu_model()
    return platforms.Platform(
        name=f"this machine ({device})", device=device, ranks_per_node=os.cpu_count() or 1, backend="gloo",
        matmul=platforms.Matmul(peak={"fp32": peak}, efficiency=[[flops, rate / peak] for flops, rate in points]),
        memory=platforms.Memory(bandwidth=memory_bandwidth()),
        dispatch_s=dispatch_table(), workloads={name: workload_rates(name) for name in TINY},
        dispatch_overlaps=False, comm_overlaps=False, collectives={"intra": links},
        sources=["measured by `repro calibrate` (repro/calibrate.py), one thread a process"],
        measured={"matmul": points, "collectives_s": {kind: list(t) for kind, t in timings.items()},
                  "measurements": [{"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "load_average": list(os.getloadavg())}]})


def store_folder(uri: str) -> Path:
    """The folder of an MLflow store (a sqlite file's, or a file store's); the working folder otherwise."""
    for prefix in ("sqlite:///", "file://"):
        if uri.startswith(prefix):
            path = Path(uri[len(prefix):])
            return path.parent if prefix == "sqlite:///" else path
    return Path.cwd()


def profile_path(folder: Path) -> Path:
    """Where this machine's profile is kept in `folder`: one file per CPU model."""
    slug = "".join(c if c.isalnum() else "-" for c in cpu_model()).strip("-").lower()
    return folder / f"platform-{slug}.yaml"


def shared_folder() -> Path:
    """Where a single `repro run` keeps this machine's profile for the next, whatever its store: the user's
    cache ($XDG_CACHE_HOME/repro, else ~/.cache/repro), so that runs with stores of their own (tests,
    scratch stores) measure the machine once."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "repro"


def kept(path: Path) -> platforms.Platform | None:
    """The profile kept at `path`, if there is one with the workloads' own rates (one from before WorkloadRates
    is measured anew)."""
    profile = platforms.load(path) if path.is_file() else None
    return profile if profile and set(TINY) <= set(profile.workloads) else None


def calibrated(folder: Path, again: bool = False, shared: bool = False) -> platforms.Platform:
    """This machine's profile from `folder` where one was made for its CPU model (with `shared`, else from
    `shared_folder()`), otherwise measured now and kept there (and, with `shared`, in the shared folder)."""
    path, copy = profile_path(folder), profile_path(shared_folder())
    for profile in (kept(path), kept(copy) if shared else None):
        if profile and not again:
            return profile
    measure_apart(path)
    if shared:
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    return platforms.load(path)


def remeasured(profile: platforms.Platform) -> platforms.Platform:
    """`profile` with another measurement of this machine folded in (`fastest`), kept where it is kept."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        measure_apart(Path(scratch) / "profile.yaml")
        again = platforms.load(Path(scratch) / "profile.yaml")
    folded = dataclasses.replace(fastest([profile, again]), path=profile.path)
    platforms.dump(folded, Path(profile.path))
    return folded


def fastest(profiles: list[platforms.Platform]) -> platforms.Platform:
    """One profile of this machine from several measurements of it, each figure at its fastest: the highest rates
    and bandwidths, the least dispatch and latency: measured in processes minutes apart, the dispatch cost of one
    workload spread 5.4-8.5 us on a quiet 2-core Intel Xeon, and a profile measured in a slow spell read every cell
    slow. What the machine's typical step takes beyond these terms, each framework's own time carries (the median of
    its passes: repro.framework_overhead), and a cell's median timing is checked against both (docs/time.md,
    "Checked where timing is testable")."""
    first = profiles[0]
    points = highest([p.measured["matmul"] for p in profiles])
    peak = max(rate for _, rate in points)
    dispatch = {name: min(p.dispatch_s[name] for p in profiles) for name in TINY}
    workloads = {name: platforms.WorkloadRates(
        matmul=highest([p.workloads[name].matmul for p in profiles]),
        activation_bandwidth=max(p.workloads[name].activation_bandwidth for p in profiles),
        state_bandwidth=max(p.workloads[name].state_bandwidth for p in profiles)) for name in TINY}
    links = {kind: platforms.Link(latency_s=min(p.collectives["intra"][kind].latency_s for p in profiles),
                                  bandwidth=max(p.collectives["intra"][kind].bandwidth for p in profiles))
             for kind in first.collectives["intra"]}
    return dataclasses.replace(
        first, matmul=platforms.Matmul(peak={"fp32": peak}, efficiency=[[flops, rate / peak] for flops, rate in points]),
        memory=platforms.Memory(bandwidth=max(p.memory.bandwidth for p in profiles)),
        dispatch_s={"default": statistics.fmean(dispatch.values()), **dispatch}, workloads=workloads,
        collectives={"intra": links}, path="",
        measured={"matmul": points, "collectives_s": {kind: [min(t) for t in zip(*(p.measured["collectives_s"][kind] for p in profiles))]
                                                      for kind in first.measured["collectives_s"]},
                  "measurements": [entry for p in profiles for entry in p.measured.get("measurements", [])]})


def highest(tables: list[list[list[float]]]) -> list[list[float]]:
    """[[size, rate], ...] tables of the same sizes as one: each size at its highest rate."""
    best: dict[float, float] = {}
    for table in tables:
        for size, rate in table:
            best[size] = max(rate, best.get(size, rate))
    return [[size, rate] for size, rate in sorted(best.items())]


def measure_apart(path: Path) -> None:
    """Measure this machine in a process of its own and keep its profile at `path`: the caller (a run's
    parent, the matrix's) imports no torch (tests/test_parent_imports.py)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "repro.calibrate", str(path)], check=True)


if __name__ == "__main__":  # measure_apart's process
    import sys

    platforms.dump(measure(), Path(sys.argv[1]))
