"""The one training loop, run by every process of every framework: `python -m repro.loop RUN_DIR`.

It reads the resolved recipe from RUN_DIR, builds the workload's model under the model seed,
hands it to the framework's adapter and trains: epochs of steps, validation after each epoch
(outside the epoch timer), device synchronisation at the timing boundaries. The reporting rank
appends structured events to RUN_DIR/events.jsonl; the parent process turns them into MLflow.

Inside the timed steps the loop reads the device once every SYNC_EVERY steps (docs/measurement.md):
losses stay on the device until then; one collective, started after the window's last step and read
after the next step, reduces the whole window, so the loop does not wait there for a peer. Ranks agree on a
stop with a vote on the host (a CPU tensor over a gloo group) every few steps (`Trainer.vote_every`),
started after one step and read after the next, so it never waits for the device. Every read goes
through `Trainer.host_read`, which counts it, so a test can hold the number per step fixed.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from repro import checkpoint, events, registry, seeding
from repro.adapters.base import Adapter, Reduction, RunContext
from repro.batches import EvenShard, GlobalBatches, batches
from repro.metrics import (
    WARMUP_STEPS, StepClock, Stopwatch, Timer, device_name, device_used_bytes, framework_median, peak_memory_bytes,
    step_time_summary,
)
from repro.rank import init_distributed, leave, pick_device, resolve_precision
from repro.recipe import Recipe
from repro.runfiles import Position, RunFolder

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # preemption and SLURM's warning before the time limit
# Steps between the loop's reads of the device (rounded up to a multiple of train.log_every): the
# window's losses are reduced in one collective and its step events written.
SYNC_EVERY = 16
# Stop votes per epoch, at least (one every SYNC_EVERY steps in a long epoch, with the loss window): a
# vote every step cost about 1 ms of a 19 ms smoke GPT-2 step on 2 processes, one every 8 steps still
# about 39 us of CPU a step (measured; each launch wakes gloo's worker thread), while a short epoch (a
# resume test's 8 steps) still gets a stop in its middle.
STOP_VOTES_PER_EPOCH = 4


class Trainer:
    """Runs the epochs of one rank and emits events on the reporting rank."""

    def __init__(self, recipe: Recipe, run_dir: Path, data_dir: Path):
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = pick_device(recipe, self.local_rank)
        recipe = resolve_precision(recipe, self.device)
        self.recipe, self.run_dir, self.folder = recipe, run_dir, RunFolder(run_dir)
        rank, world, local_rank = init_distributed(self.device, recipe.run.timeout_s)
        seeds = seeding.seed_table(recipe.seed, rank)
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # one stand-in GPU per core; also keeps CPU reductions deterministic
        seeding.make_deterministic(self.device.type == "cuda")
        workload = registry.workload_class(recipe.workload)(recipe.model, recipe.data, data_dir)
        self.ctx = RunContext(recipe, workload, rank, world, local_rank, self.device, seeds, run_dir)
        seeding.seed_everything(seeds["model_init"])
        model = workload.build_model()
        self.adapter: Adapter = registry.adapter_class(recipe.run.framework)(self.ctx)
        self.adapter.setup(model)
        seeding.seed_everything(seeds["rank_stream"])
        self.train_set, self.val_set = workload.datasets()
        self.global_batch = type(self.adapter).global_batch(recipe)
        self.reporting = rank == self.adapter.reporting_rank
        self.writer = events.EventWriter(self.folder.events_file) if self.reporting else None
        self.stop_signal: signal.Signals | None = None
        log_every = recipe.train.log_every
        self.window = log_every * -(-SYNC_EVERY // log_every)
        # (step, epoch, wall clock at the step's end, this rank's loss): events are written a window at a time,
        # each step's own time kept, so that step times can still be read from the events
        self.pending: list[tuple[int, int, float, torch.Tensor | None]] = []
        self.reducing: tuple[list[tuple[int, int]], Reduction | None] | None = None  # the window in flight
        self.phase = "setup"  # "steps" while the epoch timer runs, "epoch" between epochs
        self.host_syncs: collections.Counter[str] = collections.Counter()  # "phase/site" -> count
        self.steps_here = 0  # steps this process has run (warm-up is counted from its start)
        self.comm_step = WARMUP_STEPS - 1  # the step of this process the communication counter counts (run)
        self.vote: tuple[dist.Work | None, torch.Tensor] | None = None  # the stop vote in flight
        self.vote_every = 1  # steps between stop votes, set once the epoch length is known (run)
        self.vote_group = None  # gloo: the vote never touches a GPU
        if dist.is_initialized() and self.device.type == "cuda":
            self.vote_group = dist.new_group(backend="gloo")
        self.no_checkpoint = type(self.adapter).no_checkpoint_because(recipe.run.framework)
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.on_signal)

    def emit(self, kind: str, **fields: object) -> None:
        if self.writer:
            self.writer.emit(kind, **fields)

    def loader(self, dataset: torch.utils.data.Dataset, sampler: torch.utils.data.Sampler) -> Iterable:
        return batches(dataset, sampler, self.recipe.data.workers)

    def train_loader(self, epoch: int, skip: int = 0) -> Iterable:
        shard, seed = self.adapter.data_shard(), self.ctx.seeds["data_order"]
        sampler = GlobalBatches(len(self.train_set), self.global_batch, shard, seed, epoch, skip)
        return self.loader(self.train_set, sampler)

    def host_read(self, site: str, tensor: torch.Tensor) -> list:
        """`tensor` on the host: the loop's one way to wait for the device (counted per phase and site)."""
        self.host_syncs[f"{self.phase}/{site}"] += 1
        return tensor.tolist()

    def counters(self) -> list[contextlib.AbstractContextManager]:
        """The counters open over this process's next step (none after the first steps):
        - the activation counter's hooks over the warm-up steps plus one per process (a pipeline's
          in-flight mini-batches peak once it has filled, one per stage): a Python call per saved tensor
          would slow every step (measured: about 5% on the smoke GPT-2), and each step saves the same
          tensors, so these steps see the peak;
        - the communication counter (a profiler) around the last warm-up step, left out of the step
          times, when every framework is in its steady state (DDP has rebuilt its buckets, ZeRO's
          optimizer state exists, a pipeline of up to WARMUP_STEPS stages has filled); in a run shorter
          than the warm-up (the parity runs' 4 steps), around its last step, so that it is counted too; and
          the FLOP counter (a dispatch mode: a Python call per operation) around the same step."""
        open_now = []
        if self.steps_here < WARMUP_STEPS + self.ctx.world:
            open_now.append(self.adapter.activations.hooks())
        if self.steps_here == self.comm_step:
            open_now.append(self.adapter.communication.counting())
            open_now.append(self.adapter.flops.counting())
        return open_now

    def counted_step(
        self, inputs: object, targets: object, harness: Stopwatch, spent: Stopwatch,
    ) -> torch.Tensor | None:
        """The adapter's step, inside the counters open over it. The loop's own time (`harness`, running
        when called) stops for the step and the counters' time (`spent`)."""
        counters = self.counters()
        harness.stop()
        if counters:
            loss = self.step_counted_by(counters, inputs, targets, spent)
        else:
            loss = self.adapter.train_step(inputs, targets)
        harness.start()
        return loss

    def step_counted_by(
        self, counters: list, inputs: object, targets: object, spent: Stopwatch,
    ) -> torch.Tensor | None:
        """The adapter's step inside `counters`; what they cost goes to `spent`: entering and leaving their
        contexts, and the time their callbacks timed themselves (`spent_ns`, e.g. the activation counter's
        saved-tensor hooks)."""
        spent.start()
        hooks_before = self.counters_spent_ns()
        with contextlib.ExitStack() as stack:
            for counter in counters:
                stack.enter_context(counter)
            spent.stop()
            loss = self.adapter.train_step(inputs, targets)
            spent.start()
        spent.stop()
        spent.ns += self.counters_spent_ns() - hooks_before
        return loss

    def counters_spent_ns(self) -> int:
        """Nanoseconds the counters' callbacks have timed themselves so far (a counter without
        callbacks inside the step has no `spent_ns`: entering and leaving its context is its cost)."""
        counters = (self.adapter.activations, self.adapter.communication)
        return sum(getattr(counter, "spent_ns", 0) for counter in counters)

    def start_losses(self) -> None:
        """Start reducing the pending steps' losses, in one collective on every rank (read a step later)."""
        if self.pending:
            logged, losses = [entry[:3] for entry in self.pending], [loss for *_, loss in self.pending]
            self.pending = []
            self.reducing = (logged, self.adapter.reduce_losses(losses))

    def finish_losses(self) -> None:
        """Read the losses whose reduction started a step ago (all ranks have joined it by now) and write
        their step events."""
        if self.reducing is None:
            return
        logged, reduction = self.reducing
        self.reducing = None
        values = self.host_read("loss", reduction.result()) if reduction is not None else [None] * len(logged)
        if self.writer:
            self.writer.emit_all(events.STEP, ({"step": step, "epoch": epoch, "wall": wall, "loss": loss}
                                               for (step, epoch, wall), loss in zip(logged, values)))

    def log_losses(self) -> None:
        """Reduce every loss not yet read and write their step events (at the epoch end, or a stop)."""
        self.finish_losses()
        self.start_losses()
        self.finish_losses()

    def validate(self) -> dict[str, float]:
        shard = self.adapter.data_shard()
        batch = self.recipe.train.eval_batch or self.global_batch // shard[1]
        sampler = EvenShard(len(self.val_set), shard, batch)
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        self.adapter.set_training(False)
        try:
            for inputs, targets in self.loader(self.val_set, sampler):
                sums = self.adapter.eval_step(inputs, targets)
                if sums is not None:
                    totals += sums.detach().to(self.device, torch.float64)  # torchgpipe: on its last GPU
        finally:
            self.adapter.set_training(True)
        totals = torch.tensor(self.host_read("validation", self.adapter.reduce_metric_sums(totals)), dtype=torch.float64)
        return self.ctx.workload.finish_metric(totals) if self.reporting else {}

    def memory(self) -> dict[str, object]:
        """Peak and model-state bytes of every rank, gathered to all ranks."""
        peak, method = peak_memory_bytes(self.device)
        mine = {"rank": self.ctx.rank, "peak_bytes": peak, "method": method,
                "device_used_bytes": device_used_bytes(self.device), **self.adapter.model_state_bytes(),
                "activation_peak_bytes": self.adapter.activations.peak_bytes,
                "comm": self.adapter.communication.per_step(), "flops": self.adapter.flops.per_step()}
        ranks = [mine]
        if dist.is_initialized() and self.ctx.world > 1:
            ranks = [None] * self.ctx.world
            dist.all_gather_object(ranks, mine)
        return {"ranks": ranks}

    def run(self) -> int:
        """Train to the end (0), or until a stop signal, after which every rank saves and returns 128+signal."""
        recipe = self.recipe
        steps_per_epoch = len(self.train_loader(0))
        if steps_per_epoch == 0:
            raise ValueError(
                f"{recipe.source}: train.batch_per_gpu: the global batch ({self.global_batch}) is larger than "
                f"the training set ({len(self.train_set)} samples)"
            )
        self.vote_every = min(self.window, max(steps_per_epoch // STOP_VOTES_PER_EPOCH, 1))
        at = self.restore()
        self.comm_step = min(WARMUP_STEPS, self.planned_steps(steps_per_epoch) - at.step) - 1
        if at.step:
            self.emit(events.RESUME, step=at.step, epoch=at.epoch, epoch_step=at.epoch_step, elapsed_s=at.elapsed_s)
        else:
            self.emit(
                events.START, seeds=self.ctx.seeds, world=self.ctx.world, device=str(self.device),
                device_name=device_name(self.device),
                global_batch=self.global_batch, steps_per_epoch=steps_per_epoch, epochs=recipe.train.epochs,
                max_steps=recipe.train.max_steps, train_samples=len(self.train_set), val_samples=len(self.val_set),
                adapter=self.adapter.facts(), effective={**self.adapter.pieces(), "precision": recipe.train.precision},
            )
        for epoch in range(at.epoch, recipe.train.epochs):
            if self.done(at):
                break
            warm = max(WARMUP_STEPS - self.steps_here, 0)  # warm-up steps of this process still in this epoch
            self.phase = "steps"
            first_step, harness, counters = at.epoch_step, Stopwatch(), Stopwatch()
            with Timer(self.device) as timer:
                clock = StepClock(self.device)
                harness.start()  # the loop's own time: all but the adapter's steps and the counters (counted_step)
                for inputs, targets in self.train_loader(epoch, at.epoch_step):
                    loss = self.counted_step(inputs, targets, harness, counters)
                    at.step, at.epoch_step, self.steps_here = at.step + 1, at.epoch_step + 1, self.steps_here + 1
                    if at.step % recipe.train.log_every == 0:
                        self.pending.append((at.step, epoch, time.time(), loss))
                    clock.mark()
                    harness.lap()
                    if self.done(at):
                        break
                    self.finish_losses()
                    if at.step % self.window == 0:
                        self.start_losses()
                    if self.stop_agreed(at.step):
                        at.epoch_s += timer.seconds_so_far()
                        return self.interrupt(at, epoch)
                harness.stop()
                self.adapter.end_epoch()
            self.phase = "epoch"
            self.log_losses()
            at.epoch_s += timer.seconds
            at.elapsed_s += at.epoch_s
            samples = at.epoch_step * self.global_batch
            timed = clock.seconds()[warm:]
            step_s = {**step_time_summary(timed), "framework_median": framework_median(timed, harness.laps[warm:]),
                      "warmup": min(warm, at.epoch_step)}
            ran = at.epoch_step - first_step
            loop_us = {"harness": harness.mean_us(ran), "counters": counters.mean_us(ran)}
            metrics = self.validate()
            memory = self.memory()
            self.emit(
                events.EPOCH, epoch=epoch, step=at.step, epoch_s=at.epoch_s, elapsed_s=at.elapsed_s,
                samples=samples, samples_per_s=samples / at.epoch_s, step_s=step_s, loop_us=loop_us, val=metrics,
                **memory,
            )
            at.epoch, at.epoch_step, at.epoch_s = epoch + 1, 0, 0.0
            if self.checkpoint_due(at):
                self.save(at)
        self.read_vote()  # every collective ends before teardown
        self.emit(events.END, step=at.step, elapsed_s=at.elapsed_s, host_syncs=dict(self.host_syncs))
        return 0

    def interrupt(self, at: Position, epoch: int) -> int:
        """Log what is pending, save on every rank and return 128 + the signal."""
        self.phase = "epoch"
        self.log_losses()
        self.save(at)
        self.emit(events.INTERRUPTED, signal=self.stop_signal.name, step=at.step, epoch=epoch,
                  no_checkpoint=self.no_checkpoint)
        return 128 + self.stop_signal

    def checkpoint_due(self, at: Position) -> bool:
        """After every `checkpoint_every`-th epoch, and after the run's last (`at` has moved past the epoch)."""
        train = self.recipe.train
        return at.epoch % train.checkpoint_every == 0 or at.epoch == train.epochs or self.done(at)

    def planned_steps(self, steps_per_epoch: int) -> int:
        """Steps of the whole run: its epochs', or train.max_steps where fewer."""
        planned = steps_per_epoch * self.recipe.train.epochs
        return min(planned, self.recipe.train.max_steps) if self.recipe.train.max_steps else planned

    def done(self, at: Position) -> bool:
        return bool(self.recipe.train.max_steps and at.step >= self.recipe.train.max_steps)

    def on_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signal.Signals(signum)

    def stop_agreed(self, step: int) -> bool:
        """Whether the vote started a step ago says that some rank was asked to stop; if not, and `step`
        is a multiple of `vote_every`, start the next one. Every rank reads the same votes at the same
        steps, so all stop at the same step, at most `vote_every` + 1 steps after the signal. The vote
        is a CPU tensor: reading it never waits for a GPU, and its peers have finished it by then
        unless one is a whole step behind."""
        agreed = self.read_vote()
        if agreed:
            self.stop_signal = self.stop_signal or signal.Signals(agreed)
            return True
        if step % self.vote_every:
            return False
        flag = torch.tensor([int(self.stop_signal or 0)])
        work = None
        if dist.is_initialized() and self.ctx.world > 1:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.vote_group, async_op=True)
        self.vote = (work, flag)
        return False

    def read_vote(self) -> int:
        """The signal number the vote in flight agreed on (0: none, or no vote in flight)."""
        if self.vote is None:
            return 0
        work, flag = self.vote
        self.vote = None
        if work is not None:
            work.wait()
        (agreed,) = self.host_read("stop", flag)
        return agreed

    def barrier(self) -> None:
        if dist.is_initialized() and self.ctx.world > 1:
            dist.barrier()

    def save(self, at: Position) -> None:
        """Every rank writes its part; rank 0 makes the checkpoint current once all have finished.
        An adapter that can make no checkpoint says so once, on a stop signal's save."""
        if self.no_checkpoint:
            if self.stop_signal and self.reporting:
                print(f"repro: stopped at step {at.step} without a checkpoint: {self.no_checkpoint}", file=sys.stderr)
            return
        folder = self.folder.checkpoint_folder(at.step)
        folder.mkdir(parents=True, exist_ok=True)
        self.adapter.save_checkpoint(folder)
        state = {"position": dataclasses.asdict(at), "rng": checkpoint.rng_state()}
        checkpoint.atomic_torch_save(state, folder / f"loop-rank{self.ctx.rank}.pt")
        self.barrier()
        if self.ctx.rank == 0:
            self.folder.publish_checkpoint(folder, at)
        self.emit(events.CHECKPOINT, step=at.step, epoch=at.epoch, folder=str(folder))

    def restore(self) -> Position:
        """Continue from the run's last complete checkpoint, if it has one."""
        found = self.folder.latest_checkpoint()
        if found is None:
            return Position()
        folder, position = found
        self.adapter.load_checkpoint(folder)
        state = torch.load(folder / f"loop-rank{self.ctx.rank}.pt", weights_only=False)
        checkpoint.restore_rng(state["rng"])
        return position

    def close(self, clean: bool) -> None:
        """Release the framework and the process group. After a clean run every rank first waits for
        the others: a rank that tears down while a peer still has communication in flight aborts
        that peer (seen as SIGABRT at exit under DeepSpeed and PipeDream on gloo)."""
        if clean:
            self.barrier()
        self.adapter.teardown()
        if self.writer:
            self.writer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def train(run_dir: str) -> int:
    """Train this rank of the run in `run_dir`; the exit code: 0, or 128 + the stop signal. The process
    lives on (a rank forked by repro.warm ends through multiprocessing); `main` ends it at once."""
    folder = RunFolder(run_dir)
    trainer = Trainer(folder.recipe(), folder.path, Path(folder.read_spec().data_dir))
    clean = False
    try:
        code = trainer.run()
        clean = True
    finally:
        trainer.close(clean)
    return code


def main(run_dir: str) -> None:
    leave(train(run_dir))


if __name__ == "__main__":
    main(sys.argv[1])
