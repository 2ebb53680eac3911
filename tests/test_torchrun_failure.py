"""repro.run.torchrun_failure against the summary torch itself writes: ChildFailedError.format_msg
(torch/distributed/elastic/multiprocessing/errors/__init__.py), built here from torch's own classes."""
from __future__ import annotations

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from repro.run.torchrun_failure import ROOT_CAUSE_HEADING, describe_failure

pytestmark = pytest.mark.units


def torchrun_output(root_rank: int, exitcodes: dict[int, int], before: str = "") -> str:
    """What torchrun prints when its workers fail: their output, then the ChildFailedError it raises."""
    failures = {}
    for rank, code in exitcodes.items():
        failure = ProcessFailure(local_rank=rank % 2, pid=4000 + rank, exitcode=code, error_file="<N/A>")
        failure.timestamp = 100 if rank == root_rank else 200  # the first observed failure is the root cause
        failures[rank] = failure
    error = ChildFailedError("repro.loop", failures)
    return (f"{before}Traceback (most recent call last):\n  File \"torchrun\", line 8, in <module>\n"
            f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: {error}\n")


def test_the_root_cause_names_the_rank_and_its_exit_code_not_the_ranks_stopped_after_it() -> None:
    output = torchrun_output(root_rank=1, exitcodes={0: -15, 1: -9}, before="step 3 loss 2.5\n")
    message, rank = describe_failure(output, 1, limit=4800)
    assert rank == "1"
    head, summary = message.split("\n", 2)[:2]
    assert head == "rank 1 (local rank 1) failed with exit code -9"
    assert summary == f"{ROOT_CAUSE_HEADING}:"
    cause = message[:message.index("last output of the job:")]
    assert "pid: 4001" in cause and "pid: 4000" not in cause  # rank 0's failure is not the cause
    assert message.endswith(output[-len(output.splitlines(keepends=True)[-1]):])  # the output's last line closes


def test_of_several_nodes_summaries_the_first_printed_is_the_failure() -> None:
    first = torchrun_output(root_rank=3, exitcodes={2: -15, 3: 1})
    second = torchrun_output(root_rank=0, exitcodes={0: -15, 1: -15})
    message, rank = describe_failure(first + second, 1, limit=4800)
    assert rank == "3" and message.startswith("rank 3 (local rank 1) failed with exit code 1\n")


def test_of_several_nodes_summaries_a_rank_killed_from_outside_is_the_failure_not_its_aborted_peer() -> None:
    """Seen on the two-node Slurm cluster: rank 1 was killed; rank 0 on the other node lost its peer, gloo
    aborted it, and its node's summary was printed first."""
    aborted = torchrun_output(root_rank=0, exitcodes={0: -6})
    killed = torchrun_output(root_rank=1, exitcodes={1: -9})
    message, rank = describe_failure(aborted + killed, 1, limit=4800)
    assert rank == "1" and message.startswith("rank 1 (local rank 1) failed with exit code -9\n")


def test_without_a_summary_the_exit_code_leads_and_stack_frames_are_left_out() -> None:
    output = "RuntimeError: connection refused\nframe #0: c10d::TCPStore::check + 0x1f\nframe #1: main + 0x2\nlast line\n"
    message, rank = describe_failure(output, 3, limit=4800)
    assert rank is None
    assert message == "exit code 3\nlast output of the job:\nRuntimeError: connection refused\nlast line\n"


def test_the_message_fits_the_limit_keeping_the_summary_and_the_newest_output() -> None:
    output = torchrun_output(root_rank=0, exitcodes={0: 1}, before="".join(f"line {i}\n" for i in range(5000)))
    message, rank = describe_failure(output, 1, limit=1000)
    assert rank == "0" and len(message) == 1000
    assert message.endswith(output.splitlines(keepends=True)[-1])
    assert message.startswith("rank 0 (local rank 0) failed with exit code 1\n") and "line 4999" not in message[:200]
