"""What travels between ranks: a step's flat batch as one int64 tensor, the process groups, and the timers.

A message is a 2-element header [command, payload length] and an int64 payload. Plain integers rather than pickled
objects: two fixed-type collectives per step, no (de)serialisation beyond a list-to-tensor copy.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paceline.model.attention import SeqSlice

STOP, FORWARD, SWAP, STATS = 0, 1, 2, 3


@dataclass
class Forward:
    """What ModelRunner.forward_tokens takes: a flat batch, its layout, and the flat rows that need logits."""
    ids: list[int]
    positions: list[int]
    seqs: list[SeqSlice]
    rows: list[int]


@dataclass
class Swap:
    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]


def encode_forward(f: Forward) -> list[int]:
    out = [len(f.ids), len(f.seqs), len(f.rows), *f.ids, *f.positions]
    for s in f.seqs:
        out += [s.start, s.num_tokens, len(s.block_table)]
    for s in f.seqs:
        out += s.block_table
    return out + f.rows


def decode_forward(p: list[int]) -> Forward:
    t, n, r = p[0], p[1], p[2]
    ids, positions = p[3:3 + t], p[3 + t:3 + 2 * t]
    head = 3 + 2 * t
    at = head + 3 * n
    seqs = []
    for i in range(n):
        start, num, blocks = p[head + 3 * i:head + 3 * i + 3]
        seqs.append(SeqSlice(start, num, p[at:at + blocks]))
        at += blocks
    return Forward(ids, positions, seqs, p[at:at + r])


def encode_swap(s: Swap) -> list[int]:
    return [len(s.blocks_to_swap_out), len(s.blocks_to_swap_in),
            *(x for pair in s.blocks_to_swap_out + s.blocks_to_swap_in for x in pair)]


def decode_swap(p: list[int]) -> Swap:
    n_out = p[0]
    pairs = [(p[i], p[i + 1]) for i in range(2, len(p), 2)]
    return Swap(pairs[:n_out], pairs[n_out:])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Groups:
    """`cpu` carries messages (gloo); `device` carries activations (NCCL on CUDA, else the same gloo group).

    Backend objects built on this executor's own TCPStore, not torch.distributed's global default group: a process
    may then hold several executors (one after another in tests, or two engines side by side) and nothing global
    is left behind when one closes."""
    rank: int
    size: int
    store: dist.Store
    cpu: Any  # a c10d backend (ProcessGroupGloo / ProcessGroupNCCL)
    device: Any


def init_groups(rank: int, size: int, port: int, device: torch.device, timeout_s: float) -> Groups:
    timeout = timedelta(seconds=timeout_s)
    # loopback only: gloo would otherwise pick the interface the hostname resolves to
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timeout)
    cpu = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, size, timeout)
    dev = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size) if device.type == "cuda" else cpu
    return Groups(rank, size, store, cpu, dev)


def broadcast_message(groups: Groups, command: int, payload: list[int]) -> None:
    """Rank 0 tells every rank what to do next."""
    groups.cpu.broadcast(torch.tensor([command, len(payload)], dtype=torch.int64), 0).wait()
    if payload:
        groups.cpu.broadcast(torch.tensor(payload, dtype=torch.int64), 0).wait()


def receive_broadcast(groups: Groups) -> tuple[int, list[int]]:
    header = torch.empty(2, dtype=torch.int64)
    groups.cpu.broadcast(header, 0).wait()
    command, n = header.tolist()
    payload = torch.empty(n, dtype=torch.int64)
    if n:
        groups.cpu.broadcast(payload, 0).wait()
    return command, payload.tolist()


# Every point-to-point message uses one tag: gloo matches a peer's sends and receives of one tag in order, and each
# side posts them in the same order (header, payload, then the activations).
TAG = 0


def isend(group: Any, t: torch.Tensor, dst: int) -> tuple:
    """(handle, buffer): the buffer must live until the handle completes."""
    return group.send([t], dst, TAG), t


def recv(group: Any, t: torch.Tensor, src: int) -> torch.Tensor:
    group.recv([t], src, TAG).wait()
    return t


def send_message(groups: Groups, dst: int, command: int, payload: list[int]) -> list:
    """Point to point (pipeline stages), asynchronously: (handle, buffer) pairs the caller keeps until sent."""
    sends = [isend(groups.cpu, torch.tensor([command, len(payload)], dtype=torch.int64), dst)]
    if payload:
        sends.append(isend(groups.cpu, torch.tensor(payload, dtype=torch.int64), dst))
    return sends


def settle(sends: list, wait: bool = False) -> list:
    """The sends still under way (all of them waited for when `wait`)."""
    if wait:
        for handle, _ in sends:
            handle.wait()
        return []
    return [(h, t) for h, t in sends if not h.is_completed()]


def receive_message(groups: Groups, src: int) -> tuple[int, list[int]]:
    header = recv(groups.cpu, torch.empty(2, dtype=torch.int64), src)
    command, n = header.tolist()
    payload = torch.empty(n, dtype=torch.int64)
    if n:
        recv(groups.cpu, payload, src)
    return command, payload.tolist()


@dataclass
class Timers:
    """Seconds this rank spent computing and communicating, since the last reset."""
    forward_s: float = 0.0  # inside the model (TP: all-reduces included; PP rank 0: logits and sampling too)
    comm_s: float = 0.0  # inside collectives, or waiting for a peer's message or tensor
    steps: int = 0

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.forward_s, self.comm_s, float(self.steps)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Timers:
        forward_s, comm_s, steps = t.tolist()
        return cls(forward_s, comm_s, int(steps))

    def reset(self) -> None:
        self.forward_s = self.comm_s = 0.0
        self.steps = 0


class AllReduceLinear:
    """A row-parallel linear: this rank's partial product, summed over the group. Replaces a layer's `o` / `down`
    (plain callables in LlamaLayer), so the layer code runs unchanged on a shard."""

    def __init__(self, linear, groups: Groups, timers: Timers):
        self.linear, self.groups, self.timers = linear, groups, timers

    def __call__(self, x: torch.Tensor, **kw) -> torch.Tensor:  # kw: Int4Linear's `decodes` (LlamaLayer passes it)
        y = self.linear(x, **kw)
        t0 = time.perf_counter()
        self.groups.device.allreduce([y]).wait()
        self.timers.comm_s += time.perf_counter() - t0
        return y


def wrap_row_parallel(model, groups: Groups, timers: Timers) -> None:
    for layer in model.layers:
        layer.o = AllReduceLinear(layer.o, groups, timers)
        layer.down = AllReduceLinear(layer.down, groups, timers)
