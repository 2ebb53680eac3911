"""`make bench`: what the kit itself costs, each figure measured side by side in one run.

- the loop's own time per step, measured directly by the loop (`time/harness_us`: everything but the
  adapter's steps) inside the paired job's kit blocks, as a share of the mean step (goal: 1%);
- harness overhead: mean step time of the smoke GPT-2 on 2 processes through the kit's loop against a
  minimal loop on the framework's own API (bench/minimal.py), same model, data, sampler, batch,
  optimizer and process count. The mean, not the median: the loop's work once per window of steps
  (loss reduction, event writes) must count. Paired inside one job (bench/paired.py: alternating
  blocks, so this machine's drift hits both sides), plus the cores the follower and the launcher
  keep busy beside the ranks, read in separate jobs of `repro run` against the baseline, which also
  give the whole as a second, noisier estimate; judged only where its 95% interval clears the goal;
- data verification: `--deep` hashing throughput per core against `sha256sum` on the same files, and
  a cached re-verify of a 100,000-file manifest;
- the smoke `reproduce-table2` wall time from a fresh MLflow store.

Writes reports/bench.json, each figure beside its goal, with the load average before and after (a
loaded machine inflates every time). Usage: python bench/run.py [--only overhead,verify,table2] [--pairs 16] [--rounds 2]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from breakdown import matrix_breakdown
from repro.data import RACY_NS, HashCache, hash_tree, verify_tree
from repro.metrics import WARMUP_STEPS

ROOT = Path(__file__).resolve().parent.parent
# The recipe's 3 epochs of 64 steps at 2 processes: this machine's step times drift by about 10% over
# seconds (per-epoch means of one run, measured), so each side is sampled for as long as start-up allows.
STEPS, PROCESSES = 192, 2
REPORTS = ROOT / "reports" / "bench-matrix"  # the fresh-store matrix's own reports, kept
GOALS = {"overhead": 0.02, "harness": 0.01, "verify_per_core": 0.9, "cached_verify_s": 2.0, "table2_s": 480.0, "table2_again_s": 60.0}


def job_env(extra: dict[str, str] | None) -> dict[str, str]:
    """This environment, reading the checkout's prepared data (`make bench` runs `make data`), plus `extra`."""
    return {"REPRO_DATA": str(ROOT / "data"), **os.environ, **(extra or {})}


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """COMMAND in a scratch folder (see job_env); returns its stderr."""
    out = subprocess.run(command, cwd=cwd, env=job_env(env), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return out.stderr


# Two-sided 95% quantiles of Student's t by degrees of freedom (samples - 1); between two entries
# the lower one's, which is the wider interval
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
       20: 2.09, 30: 2.04, 40: 2.02, 60: 2.00, 120: 1.98}
SAMPLE_S = 1.0  # how often the job's processes' CPU times are read (the same on both sides)
ROLES = {"repro.cli": "follower", "torch.distributed.run": "launcher", "repro.loop": "ranks", "minimal.py": "ranks"}


def role(process: psutil.Process) -> str:
    line = " ".join(process.cmdline())
    return next((name for key, name in ROLES.items() if key in line), "other")


def sampled_run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> dict[int, list]:
    """`run`, reading every SAMPLE_S the CPU seconds of each process of the job:
    pid -> [role, [(wall time, cpu seconds), ...]]."""
    samples: dict[int, list] = {}
    with open(cwd / "stderr.log", "w+") as stderr:
        job = subprocess.Popen(command, cwd=cwd, env=job_env(env), stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        root = psutil.Process(job.pid)
        while job.poll() is None:
            with contextlib.suppress(psutil.Error):
                for process in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        times = process.cpu_times()
                        entry = samples.setdefault(process.pid, [role(process), []])
                        entry[1].append((time.time(), times.user + times.system))
            time.sleep(SAMPLE_S)
        if job.returncode:
            stderr.seek(0)
            raise RuntimeError(f"{' '.join(command)} failed:\n{stderr.read()[-3000:]}")
    return samples


def cpu_shares(samples: dict[int, list], start: float, end: float) -> dict[str, float]:
    """Cores each role kept busy between `start` and `end` (wall times), from the samples inside them."""
    shares: dict[str, float] = {}
    for name, points in samples.values():
        inside = [(t, cpu) for t, cpu in points if start <= t <= end]
        if len(inside) > 1:
            (t0, c0), (t1, c1) = inside[0], inside[-1]
            shares[name] = shares.get(name, 0.0) + (c1 - c0) / (t1 - t0)
    return shares


def repro_steps(framework: str, scratch: Path) -> dict[str, object]:
    """Step times of one `repro run` after its warm-up, from its epoch events: the mean over all its
    steps (validation between epochs is outside them) and the count; the cores its processes kept
    busy while it trained, and the loop's host reads per step (its end event)."""
    samples = sampled_run([sys.executable, "-m", "repro.cli", "run", "gpt2", "--framework", framework,
                           "--gpus", str(PROCESSES), "--max-steps", str(STEPS),
                           "--tracking-uri", f"sqlite:///{scratch}/mlflow.db"], scratch)
    newest = max((scratch / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    written = [json.loads(line) for line in (newest / "events.jsonl").read_text().splitlines()]
    epochs = [e["step_s"] for e in written if e["event"] == "epoch"]
    (start,), (end,) = [e for e in written if e["event"] == "start"], [e for e in written if e["event"] == "end"]
    count = sum(e["count"] for e in epochs)
    reads = sum(n for site, n in end["host_syncs"].items() if site.startswith("steps/"))
    harness = sum(e["loop_us"]["harness"] * e["samples"] for e in written if e["event"] == "epoch") / (end["step"] * start["global_batch"])
    return {"mean": sum(e["mean"] * e["count"] for e in epochs) / count, "count": count, "harness_us": harness,
            "cores": cpu_shares(samples, start["wall"], end["wall"]), "host_reads_per_step": reads / end["step"]}


def bench_job(script: str, framework: str, out: Path, count: int) -> list[str]:
    """A bench script (bench/minimal.py, bench/paired.py) on PROCESSES ranks under plain torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(PROCESSES),
            str(ROOT / "bench" / script), framework, str(out), str(count)]


def minimal_steps(framework: str, scratch: Path) -> dict[str, object]:
    out = scratch / f"minimal-{framework}.json"
    samples = sampled_run(bench_job("minimal.py", framework, out, STEPS), scratch, {"PYTHONPATH": str(ROOT)})
    timing = json.loads(out.read_text())
    steady = timing["steps_s"][WARMUP_STEPS:]
    return {"mean": statistics.fmean(steady), "count": len(steady),
            "cores": cpu_shares(samples, timing["start_wall"], timing["end_wall"])}


def interval95(values: list[float]) -> list[float] | None:
    """Student's t interval of the mean of `values` (None for fewer than 2)."""
    if len(values) < 2:
        return None
    t = T95[max(df for df in T95 if df <= len(values) - 1)]
    half = t * statistics.stdev(values) / len(values) ** 0.5
    return [statistics.fmean(values) - half, statistics.fmean(values) + half]


def paired_in_job(framework: str, count: int) -> dict[str, object]:
    """Kit against baseline in `count` pairs of blocks inside one job (bench/paired.py)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"paired-{framework}.json"
        run(bench_job("paired.py", framework, out, count), Path(tmp), {"PYTHONPATH": str(ROOT)})
        return paired_summary(json.loads(out.read_text()))


def paired_summary(found: dict) -> dict[str, object]:
    """The paired job's figures from what it wrote: the kit's mean step against the baseline's, as a share
    and in microseconds a step, each with its 95% interval, and the loop's own time (harness_share)."""
    pairs = found["pairs"]
    kit, minimal = (statistics.fmean(pair[side] for pair in pairs) for side in ("kit", "minimal"))
    interval = interval95([pair["kit"] / pair["minimal"] - 1 for pair in pairs])
    return {"overhead": kit / minimal - 1, "interval95": interval,
            # the same in microseconds a step, to set beside the loop's own time (harness.us)
            "overhead_us": (kit - minimal) * 1e6,
            "interval95_us": [bound * minimal * 1e6 for bound in interval] if interval else None,
            "repro_step_s": kit, "minimal_step_s": minimal, "steps_per_block": found["steps_per_block"], "warm_up": found["warm_up"],
            "harness": harness_share(pairs), "pairs": pairs}


def harness_share(pairs: list[dict]) -> dict[str, object]:
    """The loop's own time per step, measured directly inside the kit's blocks (`loop_us.harness`: all
    but the adapter's steps), as microseconds and as a share of the block's mean step; judged against
    the 1% goal by the 95% interval of the blocks' shares."""
    shares = [pair["harness_us"] / (pair["kit"] * 1e6) for pair in pairs]
    interval, goal = interval95(shares), GOALS["harness"]
    return {"us": statistics.fmean(pair["harness_us"] for pair in pairs), "share": statistics.fmean(shares),
            "interval95": interval, "goal": goal, "met": verdict(interval, goal)}


def overhead(framework: str, rounds: int, pairs: int) -> dict[str, object]:
    """The kit's cost per step: the loop's, paired inside one job, plus what its processes beside the
    ranks cost (read in separate jobs, which also give a second, noisier estimate of the whole)."""
    started = time.perf_counter()
    separate, paired = separate_jobs(framework, rounds), paired_in_job(framework, pairs)
    spent = separate["budget"]
    extra_launcher = max(spent["extra_launcher_us_per_step"], 0.0)  # same torchrun plus --tee: never less
    beside = (spent["follower_us_per_step"] + extra_launcher) / (paired["repro_step_s"] * 1e6)
    goal = GOALS["overhead"]
    interval = [bound + beside for bound in paired["interval95"]] if paired["interval95"] else None
    whole = verdict(separate["interval95"], goal)
    return {"overhead": paired["overhead"] + beside, "goal": goal, "met": overhead_met(verdict(interval, goal), whole),
            "interval95": interval, "beside_ranks": beside, "harness": paired["harness"], "paired": paired,
            "separate_jobs": {**separate, "met": whole}, "seconds": time.perf_counter() - started}


def overhead_met(parts: bool | None, whole: bool | None) -> bool | None:
    """The verdict on the sum of the parts, unless the whole, seen directly in separate jobs, lies above
    the goal: the sum misses whatever acts between its parts (a rank the follower preempts holds up
    its peer at the next collective)."""
    return False if whole is False else parts


def verdict(interval: list[float] | None, goal: float) -> bool | None:
    """Met where the whole 95% interval is within the goal, not met where it lies above it, None where
    it holds the goal or there is none (a single sample): the measurement cannot tell."""
    if interval is None:
        return None
    low, high = interval
    return True if high <= goal else False if low > goal else None


def separate_jobs(framework: str, count: int) -> dict[str, object]:
    """Kit against baseline as separate jobs, in `count` alternating pairs (the order flips each round),
    with what the kit's processes cost beside its ranks (the per-step budget of what remains)."""
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(count):
            pair = {}
            for side in (("repro", "minimal") if index % 2 == 0 else ("minimal", "repro")):
                pair[side] = (repro_steps if side == "repro" else minimal_steps)(framework, Path(tmp))
            rounds.append(pair)
    kit = statistics.fmean(r["repro"]["mean"] for r in rounds)
    minimal = statistics.fmean(r["minimal"]["mean"] for r in rounds)
    each = [r["repro"]["mean"] / r["minimal"]["mean"] - 1 for r in rounds]
    return {"overhead": kit / minimal - 1, "interval95": interval95(each), "repro_step_s": kit, "minimal_step_s": minimal,
            "per_round": each, "rounds": rounds, "steps_per_run": rounds[0]["repro"]["count"],
            "warmup_steps": WARMUP_STEPS, "budget": budget(rounds, kit)}


def budget(rounds: list[dict], step_s: float) -> dict[str, float]:
    """What the kit adds per step beside its ranks' work: the cores its follower and launcher kept busy
    while it trained (against the baseline's launcher), as microseconds of one core per step, and the
    loop's host reads per step."""
    def mean_cores(side: str, name: str) -> float:
        return statistics.fmean(r[side]["cores"].get(name, 0.0) for r in rounds)

    return {"follower_cores": mean_cores("repro", "follower"), "launcher_cores": mean_cores("repro", "launcher"),
            "baseline_launcher_cores": mean_cores("minimal", "launcher"),
            "follower_us_per_step": mean_cores("repro", "follower") * step_s * 1e6,
            "extra_launcher_us_per_step": (mean_cores("repro", "launcher") - mean_cores("minimal", "launcher")) * step_s * 1e6,
            "host_reads_per_step": statistics.fmean(r["repro"]["host_reads_per_step"] for r in rounds),
            "harness_us": statistics.fmean(r["repro"]["harness_us"] for r in rounds)}


def verify_speed() -> dict[str, float]:
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        names = [f"shard{i}.bin" for i in range(max(cores, 2) * 2)]
        chunk = os.urandom(1 << 20)
        for name in names:
            with open(root / name, "wb") as f:
                for _ in range(64):  # 64 MiB each
                    f.write(chunk)
        total = 64 * len(names)
        start = time.perf_counter()
        run(["sha256sum", *names], root)
        sha256sum_rate = total / (time.perf_counter() - start)  # one process: one core
        manifest = hash_tree(root, names)
        start = time.perf_counter()
        verify_tree(root, manifest, deep=True, cache=HashCache(root / "cache.json"))
        repro_rate = total / (time.perf_counter() - start)
        cached = cached_verify(root / "many")
    per_core = repro_rate / min(cores, len(names)) / sha256sum_rate
    return {"sha256sum_mib_s": sha256sum_rate, "repro_mib_s": repro_rate, "cores": cores,
            "per_core_ratio": per_core, "goal_per_core": GOALS["verify_per_core"],
            "cached_verify_100k_s": cached, "goal_cached_s": GOALS["cached_verify_s"]}


def cached_verify(root: Path, count: int = 100_000) -> float:
    """Seconds for a second verify of an unchanged 100,000-file tree (hashes come from the cache)."""
    for index in range(count):
        folder = root / f"{index // 1000:03d}"
        if index % 1000 == 0:
            folder.mkdir(parents=True)
        (folder / f"{index}.txt").write_text(str(index))
    names = [f"{i // 1000:03d}/{i}.txt" for i in range(count)]
    manifest = hash_tree(root, names)
    cache_file = root.parent / "many-cache.json"
    time.sleep(RACY_NS / 1e9)  # files written less than this before hashing are hashed again next time
    verify_tree(root, manifest, cache=HashCache(cache_file))
    start = time.perf_counter()
    verify_tree(root, manifest, cache=HashCache(cache_file))
    return time.perf_counter() - start


def table2_wall() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        said = run([sys.executable, "-m", "repro.cli", "table2", "--scale", "smoke", "--reports", str(REPORTS),
                    "--tracking-uri", f"sqlite:///{tmp}/mlflow.db"], Path(tmp))
        first = time.perf_counter() - start
        phases = matrix_breakdown(Path(tmp) / "runs")
        # the closing summary ("matrix: N ran, ..."), not the plan's opening "matrix: N runs, ..." line
        [matrix] = [line for line in said.splitlines() if re.match(r"matrix: \d+ ran, ", line)]
        start = time.perf_counter()
        run([sys.executable, "-m", "repro.cli", "table2", "--scale", "smoke", "--reports", str(REPORTS),
             "--tracking-uri", f"sqlite:///{tmp}/mlflow.db"], Path(tmp))
        second = time.perf_counter() - start
    return {"first_s": first, "goal_s": GOALS["table2_s"], "met": first <= GOALS["table2_s"],
            "second_s": second, "goal_second_s": GOALS["table2_again_s"], "matrix": matrix, "breakdown": phases}


VERDICTS = {True: "met", False: "not met", None: "not resolved here (its 95% interval holds the goal)"}


def bounds(interval: list[float] | None) -> tuple[float, float]:
    """An interval's ends for printing (nan without one)."""
    return tuple(interval) if interval else (float("nan"), float("nan"))


def print_overhead(framework: str, figure: dict) -> None:
    paired, separate, spent = figure["paired"], figure["separate_jobs"], figure["separate_jobs"]["budget"]
    harness = figure["harness"]
    low, high = bounds(harness["interval95"])
    print(f"loop's own time {framework}: {harness['us']:.0f} us a step, {harness['share']:.2%} of the kit's mean step "
          f"(goal <= {harness['goal']:.0%}; 95% interval {low:.2%}..{high:.2%}): {VERDICTS[harness['met']]}")
    low, high = bounds(figure["interval95"])
    print(f"harness overhead {framework}: {figure['overhead']:+.1%} (goal <= {GOALS['overhead']:.0%}; 95% interval "
          f"{low:+.1%}..{high:+.1%}): {VERDICTS[figure['met']]}")
    pair_low, pair_high = bounds(paired["interval95"])
    us_low, us_high = bounds(paired["interval95_us"])
    print(f"  the loop, paired in one job: {paired['overhead']:+.1%} ({paired['repro_step_s'] * 1e3:.2f} ms vs "
          f"{paired['minimal_step_s'] * 1e3:.2f} ms per step over {len(paired['pairs'])} pairs of "
          f"{paired['steps_per_block']}-step blocks; interval {pair_low:+.1%}..{pair_high:+.1%}), "
          f"{paired['overhead_us']:+.0f} us a step ({us_low:+.0f}..{us_high:+.0f}) beside the loop's own "
          f"{harness['us']:.0f} us")
    print(f"  beside the ranks: {figure['beside_ranks']:+.2%}: follower {spent['follower_cores']:.1%} of a core "
          f"({spent['follower_us_per_step']:.0f} us a step), launcher +{spent['extra_launcher_us_per_step']:.0f} us "
          f"a step over the baseline's; the loop reads the host {spent['host_reads_per_step']:.3f} times a step")
    rounds = ", ".join(f"{value:+.1%}" for value in separate["per_round"])
    sep_low, sep_high = bounds(separate["interval95"])
    print(f"  as separate jobs: {separate['overhead']:+.1%} ({separate['repro_step_s'] * 1e3:.2f} ms vs "
          f"{separate['minimal_step_s'] * 1e3:.2f} ms; rounds {rounds}; interval {sep_low:+.1%}..{sep_high:+.1%}): "
          f"on its own {VERDICTS[separate['met']]}")
    print(f"  ({figure['seconds'] / 60:.1f} minutes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="overhead,verify,table2")
    # the defaults keep `--only overhead` (DDP and ZeRO) near 8 minutes on a quiet 2-core machine
    parser.add_argument("--rounds", type=int, default=2, help="alternating kit/baseline jobs per framework")
    parser.add_argument("--pairs", type=int, default=16, help="alternating kit/baseline blocks inside one job")
    parser.add_argument("--frameworks", default="ddp,zero", help="frameworks of the overhead figure")
    args = parser.parse_args()
    parts = args.only.split(",")
    results: dict[str, object] = {"cores": os.cpu_count(), "load_before": os.getloadavg()}
    if "overhead" in parts:
        for framework in args.frameworks.split(","):
            results[f"overhead_{framework}"] = figure = overhead(framework, args.rounds, args.pairs)
            print_overhead(framework, figure)
    if "verify" in parts:
        results["verify"] = figure = verify_speed()
        print(f"verify --deep: {figure['per_core_ratio']:.2f}x sha256sum per core "
              f"({figure['repro_mib_s']:.0f} MiB/s on {figure['cores']} cores vs {figure['sha256sum_mib_s']:.0f} MiB/s; goal >= 0.9x)")
        print(f"cached re-verify of 100,000 files: {figure['cached_verify_100k_s']:.2f}s (goal < 2s)")
    if "table2" in parts:
        results["table2"] = figure = table2_wall()
        print(f"smoke reproduce-table2: {figure['first_s']:.0f}s from a fresh store (goal <= {GOALS['table2_s']:.0f}s), "
              f"second call {figure['second_s']:.0f}s (goal < {GOALS['table2_again_s']:.0f}s)")
        print(f"  {figure['matrix']}")
        totals = figure["breakdown"]["totals"]
        print("  where it went, summed over cells: " + ", ".join(f"{k} {v:.0f}" for k, v in totals.items())
              + " (train_s: the frameworks' own steps, the floor of the matrix's time)")
    results["load_after"] = os.getloadavg()
    print(f"load average before {results['load_before'][0]:.1f}, after {results['load_after'][0]:.1f} "
          f"on {results['cores']} cores")
    (ROOT / "reports").mkdir(exist_ok=True)
    (ROOT / "reports" / "bench.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
