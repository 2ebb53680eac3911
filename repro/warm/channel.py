"""The messages between a parent and its warm launcher: JSON, one per packet of a SOCK_SEQPACKET socket
pair, file descriptors attached where a message hands one over (a job's output pipe).

  parent -> launcher: {"job": {"entry": "module:function", "args": [...], "nprocs": N, "log_dir": path}}
                      with the write end of the job's output pipe; {"signal": N}
  launcher -> parent: {"pids": {rank: pid}} once the ranks run; {"returncode": N, "exit_codes": {...}} at the end

The end of the channel (a closed socket) ends the other side: a launcher whose parent is gone stops its ranks.
"""
from __future__ import annotations

import json
import socket
from typing import Any

MAX_MESSAGE = 1 << 16


def pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(channel: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(channel, [data], list(fds))
    else:
        channel.sendall(data)


def receive(channel: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors attached to it; (None, []) when the other side has closed."""
    data, fds, _flags, _address = socket.recv_fds(channel, MAX_MESSAGE, 4)
    return (json.loads(data) if data else None), fds
