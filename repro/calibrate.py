"""`repro calibrate`: measure this machine and write its platform profile (repro.model.platforms), the
figures the step-time model (repro.model.time) reads. In well under a minute, one thread a process as
the CPU stand-ins train (repro.loop):

- matrix multiplies of square matrices from 16 to 512 (FLOPs 2 n^3 each): the rate by operation size;
- a copy of 64 MiB: the bandwidth of memory-bound operations (bytes read and written);
- the host's cost of one dispatched operation, per workload: its training step at a size whose FLOPs
  are negligible (TINY), timed, over the aten operations the step dispatches (TorchDispatchMode);
- per collective kind, 2 gloo processes: the time of 4 bytes (latency) and of 4 MiB (bandwidth on the
  wire, repro.model.costs.wire_bytes).

A profile made here is kept (`profile_path`) and reused while the CPU model is the same.
"""
from __future__ import annotations

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


def tiny_batch(workload: str, recipe: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One random sample of `recipe`'s workload: token ids and next tokens, or an image and its class."""
    import torch

    from repro.shapes import shape_of

    shape = shape_of(workload, recipe.model, recipe.data.dataset)
    if workload == "gpt2":
        return torch.randint(0, shape.vocab, (1, shape.seq_len)), torch.randint(0, shape.vocab, (1, shape.seq_len))
    return torch.randn(1, 3, shape.image_size, shape.image_size), torch.randint(0, shape.classes, (1,))


# each workload at a size whose FLOPs are negligible, so a step's time is its operations' dispatch
TINY = {"gpt2": ["model.d_model=8", "model.n_head=1", "model.seq_len=4"],
        "vgg16": ["model.width_div=64", "model.classifier_width=8"]}


def dispatch_seconds(workload: str) -> float:
    """Seconds per aten operation of `workload`'s training step (forward, loss, backward, optimizer) at
    a negligible size (TINY): its step's time over the operations it dispatches (TorchDispatchMode)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from repro import registry
    from repro.optim import make_optimizer
    from repro.recipe import load_file, recipe_path

    recipe = load_file(recipe_path(workload, "smoke"), TINY[workload])
    built = registry.workload_class(workload)(recipe.model, recipe.data, Path("."))
    model = built.build_model()
    optimizer = make_optimizer(recipe.train.optimizer, model.parameters())
    inputs, targets = tiny_batch(workload, recipe)

    def step() -> None:
        output = model(inputs)
        torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    step()
    with Count():
        step()
    return best_seconds(step, 10) / Count.ops


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
        dispatch_s=dispatch_table(),
        dispatch_overlaps=False, comm_overlaps=False, collectives={"intra": links},
        sources=["measured by `repro calibrate` (repro/calibrate.py), one thread a process"],
        measured={"matmul": points, "collectives_s": {kind: list(t) for kind, t in timings.items()},
                  "load_average": list(os.getloadavg()), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


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


def calibrated(folder: Path, again: bool = False, shared: bool = False) -> platforms.Platform:
    """This machine's profile from `folder` where one was made for its CPU model (with `shared`, else from
    `shared_folder()`), otherwise measured now and kept there (and, with `shared`, in the shared folder)."""
    path, copy = profile_path(folder), profile_path(shared_folder())
    for kept in (path, copy) if shared else (path,):
        if kept.is_file() and not again:
            return platforms.load(kept)
    profile = measure()
    for target in (path, copy) if shared else (path,):
        platforms.dump(profile, target)
    return platforms.load(path)
