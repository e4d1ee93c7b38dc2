"""engine/heap.py: a step's freed activations stay in the heap, so the next step does not fault them in again."""
import platform
import subprocess
import sys

import pytest

# One "step" as a 1,500-token prompt allocates on the engine thread: per layer a few 3-9 MB blocks, each freed
# after the next one is made. Run in a fresh interpreter, since the thresholds are process-wide and sticky.
SCRIPT = """
import resource, sys, threading, torch
from paceline.engine.heap import keep_freed_memory
if sys.argv[1] == "1":
    assert keep_freed_memory()
def step():
    h = torch.ones(1500 * 576)
    for _ in range(8):
        qkv = torch.ones(1500 * 960); att = torch.ones(1500 * 576); del qkv
        o = torch.ones(1500 * 576); del att; h2 = h + o; del o, h; h = h2
        gu = torch.ones(1500 * 3072, dtype=torch.bfloat16); s = torch.ones(1500 * 1536, dtype=torch.bfloat16); del gu
        d = torch.ones(1500 * 576); del s; h2 = h + d; del d, h; h = h2
def work(out):
    torch.set_num_threads(1)
    step()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(4):
        step()
    out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
out = []
thread = threading.Thread(target=work, args=(out,))
thread.start()
thread.join()
print(out[0])
"""


def faults(keep: bool) -> int:
    run = subprocess.run([sys.executable, "-c", SCRIPT, "1" if keep else "0"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_steps_after_the_first_fault_nothing_in():
    without, kept = faults(False), faults(True)
    assert without > 1000  # glibc's defaults hand the blocks back: the pattern is one that needs the setting
    assert kept < 50


def test_switched_off_by_the_environment(monkeypatch):
    from paceline.engine.heap import keep_freed_memory

    monkeypatch.setenv("PACELINE_KEEP_HEAP", "0")
    keep_freed_memory.cache_clear()  # cached per process: an engine built earlier in this run asked already
    assert keep_freed_memory() is False
    keep_freed_memory.cache_clear()
