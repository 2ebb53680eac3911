"""What torchrun's failure summary says: the rank that failed first, its exit code, and the summary itself.

torchrun ends a failed job with ChildFailedError.format_msg (torch/distributed/elastic/multiprocessing/
errors/__init__.py, `_MSG_FORMAT_TEMPLATE` and `_FAILURE_FORMAT_TEMPLATE`): a border of "=", the title,
the other failures, then under "Root Cause (first observed failure):" the first failed rank as
"  rank      : 1 (local_rank: 1)" and "  exitcode  : -9 (pid: 123) (Signals.SIGKILL: 9)", and a closing
border of "=". In a job of several nodes each node's torchrun prints one, in no reliable order.
"""
from __future__ import annotations

import re

from repro.launch import root_cause

ROOT_CAUSE_HEADING = "Root Cause (first observed failure)"
ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
SUMMARY_END = re.compile(r"^=+$", re.MULTILINE)
# C++ stack frames that c10d appends to an error ("frame #3: c10d::... + 0x1f"): noise in repro.error
STACK_FRAME = re.compile(r"^.*frame #\d+: .*\n?", re.MULTILINE)
TAIL_LINES = 80  # of the job's output, after the summary
TAIL_HEADING = "\nlast output of the job:\n"


def describe_failure(output: str, returncode: int | None, limit: int) -> tuple[str, str | None]:
    """(message, failing global rank) from a failed job's whole output: the root cause among the failure
    summaries (one per node; launch.root_cause), then the output's last lines, in at most `limit` characters;
    C++ stack frames are left out. Without a summary (the job failed before torchrun's agent did), the exit
    code leads."""
    output = STACK_FRAME.sub("", output)
    tail = "".join(output.splitlines(keepends=True)[-TAIL_LINES:])
    causes = root_causes(output)
    if not causes:
        head, rank = f"exit code {returncode}", None
    else:
        first = root_cause({index: int(cause.group(3)) for index, (_, cause) in enumerate(causes)})
        heading, cause = causes[first]
        rank, local_rank, code = cause.groups()
        end = SUMMARY_END.search(output, cause.end())
        summary = output[heading:end.start() if end else cause.end()].rstrip()
        head = f"rank {rank} (local rank {local_rank}) failed with exit code {code}\n{summary}"
    room = max(limit - len(head) - len(TAIL_HEADING), 0)
    return f"{head}{TAIL_HEADING}{tail[-room:] if room else ''}", rank


def root_causes(output: str) -> list[tuple[int, re.Match]]:
    """Every summary's root cause in the order printed: (where its heading starts, its rank match)."""
    found, heading = [], output.find(ROOT_CAUSE_HEADING)
    while heading >= 0:
        cause = ROOT_CAUSE.search(output, heading)
        if cause:
            found.append((heading, cause))
        heading = output.find(ROOT_CAUSE_HEADING, heading + 1)
    return found
