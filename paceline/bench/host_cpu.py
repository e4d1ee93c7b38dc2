"""How busy the host was while a benchmark ran, from /proc (Linux).

On a shared machine a run's figures mean something only if nothing else took the cores meanwhile: a snapshot
before and after a run gives the CPU every process used (/proc/stat), the time the hypervisor stole, and the
benchmark's own share (this process, its children once joined, and a server's session when one is named), so the
cores' worth that something else used is measured rather than guessed.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


@dataclass(frozen=True)
class Snapshot:
    """CPU ticks (1/SC_CLK_TCK s) used so far, and the wall clock (time.monotonic())."""
    t: float
    busy: int  # every core's user, nice, system, irq and softirq time: idle, iowait and steal left out
    steal: int
    ours: int  # this process's utime + stime, with its children's once they were waited for


def proc_ticks(pid: int) -> tuple[int, int, int]:
    """(session id, utime + stime, cutime + cstime) of one process in clock ticks, all its threads included, the
    last its waited-for children's; (0, 0, 0) if it is gone."""
    try:
        # the name (field 2) may hold spaces and parentheses: count the fields from the last ")"
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0, 0, 0
    return int(fields[3]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])  # proc(5): 6, 14-17


def session_ticks(sids: set[int]) -> int:
    """CPU ticks used so far by every process of these sessions (a server and, for vLLM, its engine process)."""
    total = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            sid, ticks, _ = proc_ticks(int(d.name))
            if sid in sids:
                total += ticks
    return total


def snapshot() -> Snapshot:
    cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = cpu[:8]
    _, own, children = proc_ticks(os.getpid())
    return Snapshot(time.monotonic(), user + nice + system + irq + softirq, steal, own + children)


@dataclass(frozen=True)
class Span:
    """CPU seconds used between two snapshots."""
    wall_s: float
    all_s: float  # by every process on the machine
    ours_s: float  # by the benchmark: this process, its joined children and the server's ticks passed in
    steal_s: float
    server_s: float

    @property
    def other_cores(self) -> float:
        """Cores' worth of CPU that something other than the benchmark used: what a "host stall" is made of."""
        return max(self.all_s - self.ours_s, 0.0) / self.wall_s


def between(before: Snapshot, after: Snapshot, server_ticks: int = 0) -> Span:
    """What was used from `before` to `after`; server_ticks: a server's own use meanwhile (session_ticks' change),
    counted as the benchmark's."""
    hz = os.sysconf("SC_CLK_TCK")
    return Span(wall_s=max(after.t - before.t, 1e-9), all_s=(after.busy - before.busy) / hz,
                ours_s=(after.ours - before.ours + server_ticks) / hz, steal_s=(after.steal - before.steal) / hz,
                server_s=server_ticks / hz)


def other_cpu(before: Snapshot, after: Snapshot, server_ticks: int) -> dict[str, float]:
    """Cores' worth of CPU that something other than this benchmark and the server under test used during a run,
    the time the hypervisor stole, and the server's own, as a run's "host" record."""
    span = between(before, after, server_ticks)
    return {"other_cores": span.other_cores, "steal_cores": span.steal_s / span.wall_s,
            "server_cores": span.server_s / span.wall_s}


@contextmanager
def watch(server_session: int) -> Iterator[dict[str, float]]:
    """`with watch(srv.proc.pid) as host: <the run>`: afterwards `host` holds other_cpu's record of the run, the
    server's use being that of every process in its session (the server runs in a session of its own)."""
    host: dict[str, float] = {}
    before, server_before = snapshot(), session_ticks({server_session})
    yield host
    host.update(other_cpu(before, snapshot(), session_ticks({server_session}) - server_before))
