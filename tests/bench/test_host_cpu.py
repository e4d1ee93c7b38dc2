"""paceline.bench.host_cpu: how much of the host something other than the benchmark took during a run."""
import os
import subprocess
import sys
import time

import pytest

from paceline.bench import host_cpu

HZ = os.sysconf("SC_CLK_TCK")


def test_other_cpu_is_the_busy_time_that_was_not_ours():
    before = host_cpu.Snapshot(t=0.0, busy=0, steal=0, ours=0)
    after = host_cpu.Snapshot(t=10.0, busy=15 * HZ, steal=2 * HZ, ours=1 * HZ)
    host = host_cpu.other_cpu(before, after, server_ticks=10 * HZ)
    assert host == pytest.approx({"other_cores": 0.4, "steal_cores": 0.2, "server_cores": 1.0})
    used = host_cpu.between(before, after)  # no server: all but this process's second is someone else's
    assert (used.wall_s, used.all_s, used.ours_s) == pytest.approx((10.0, 15.0, 1.0))
    assert used.other_cores == pytest.approx(1.4)
    # more counted as ours than the machine used (ticks sampled at different instants): none other, not negative
    assert host_cpu.between(before, after, server_ticks=20 * HZ).other_cores == 0.0


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_busy_loop_here_and_in_a_joined_child_counts_as_ours():
    before = host_cpu.snapshot()
    _spin(0.3)
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                    "while time.process_time() < end: pass"], check=True)
    used = host_cpu.between(before, host_cpu.snapshot())
    assert used.ours_s >= 0.55  # both spins, the child's once it was waited for
    assert used.all_s >= used.ours_s - 0.05  # the machine's busy time includes ours (tick rounding aside)


def test_a_server_session_is_counted_apart():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        assert host_cpu.proc_ticks(child.pid)[0] == child.pid  # a session of its own, named by its pid
        with host_cpu.watch(child.pid) as host:
            start, deadline = host_cpu.session_ticks({child.pid}), time.monotonic() + 30
            while host_cpu.session_ticks({child.pid}) - start < HZ // 5 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert host["server_cores"] > 0 and set(host) == {"other_cores", "steal_cores", "server_cores"}
    finally:
        child.kill()
        child.wait()
    assert host_cpu.proc_ticks(child.pid) == (0, 0, 0)  # gone
