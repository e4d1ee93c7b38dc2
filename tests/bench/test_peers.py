import sys
from pathlib import Path

import httpx
import pytest

from paceline.bench.peers import Server, System, llama_server_system, paceline_system

FAKE = str(Path(__file__).parent / "fake_server.py")


def test_server_starts_answers_and_stops(tmp_path):
    system = System("fake", [sys.executable, FAKE, "{port}"], startup_timeout_s=60)
    with Server(system, tmp_path / "fake.log") as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        proc = srv.proc
    assert proc.poll() is not None  # stopped on exit
    assert (tmp_path / "fake.log").read_text().startswith("$ ")


def test_a_server_that_dies_at_startup_is_an_error_with_its_log(tmp_path):
    system = System("dies", [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="exited with code 3.*no such model"):
        with Server(system, tmp_path / "dies.log"):
            pass


def test_system_command_lines(monkeypatch, tmp_path):
    p = paceline_system("sarathi", 256, "m.gguf", threads=2)
    assert p.name == "paceline-sarathi-256" and p.is_paceline and p.env == {"OMP_NUM_THREADS": "2"}
    assert p.argv[p.argv.index("--scheduler") + 1] == "sarathi" and "{port}" in p.argv
    assert paceline_system("vllm", 1024, "m.gguf").name == "paceline-vllm"
    timed = paceline_system("sarathi", 512, "m.gguf", max_step_ms=120)
    assert timed.name == "paceline-sarathi-512-120ms" and timed.argv[timed.argv.index("--max-step-ms") + 1] == "120"
    assert "--max-step-ms" not in p.argv
    monkeypatch.setenv("PACELINE_LLAMA_SERVER", str(tmp_path / "missing"))
    assert "no llama-server binary" in llama_server_system(8, 512, "m.gguf", 2048).skip
    exe = tmp_path / "llama-server"
    exe.write_text("")
    monkeypatch.setenv("PACELINE_LLAMA_SERVER", str(exe))
    ls = llama_server_system(32, 512, "m.gguf", 2048)
    assert ls.skip is None and not ls.send_priority
    a = ls.argv
    assert a[a.index("-np") + 1] == "32" and a[a.index("-b") + 1] == a[a.index("-ub") + 1] == "512"
    assert a[a.index("-c") + 1] == str(32 * 2048) and "-cb" in a


def test_vllm_cpu_system(monkeypatch, tmp_path):
    from paceline.bench.peers import vllm_cpu_system
    monkeypatch.setenv("PACELINE_VLLM_PYTHON", str(tmp_path / "missing" / "python"))
    assert "no vLLM CPU install" in vllm_cpu_system("m.gguf").skip
    exe = tmp_path / "python"
    exe.write_text("")
    monkeypatch.setenv("PACELINE_VLLM_PYTHON", str(exe))
    folder = tmp_path / "hf"  # an HF folder is used as is: no conversion
    folder.mkdir()
    default = vllm_cpu_system(str(folder), threads=2)
    assert default.skip is None and default.name == "vllm-cpu" and not default.send_priority
    a = default.argv
    assert a[:3] == [str(exe), "-m", "vllm.entrypoints.openai.api_server"]
    assert a[a.index("--model") + 1] == str(folder) == default.model and a[a.index("--dtype") + 1] == "bfloat16"
    assert "{port}" in a and "--max-num-batched-tokens" not in a  # its own default budget
    assert default.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and default.env["OMP_NUM_THREADS"] == "2"
    assert default.env["HF_HUB_OFFLINE"] == "1" and default.startup_timeout_s >= 300
    small = vllm_cpu_system(str(folder), budget=64, max_num_seqs=32)
    b = small.argv
    assert small.name == "vllm-cpu-64" and b[b.index("--max-num-batched-tokens") + 1] == "64"
    assert b[b.index("--max-num-seqs") + 1] == "32"
    assert vllm_cpu_system(str(folder), budget=64).argv[-1] == "64"  # --max-num-seqs follows a budget below 128
    assert "--max-num-seqs" not in vllm_cpu_system(str(folder), budget=256).argv
    fp32 = vllm_cpu_system(str(folder), budget=64, dtype="float32")
    assert fp32.name == "vllm-cpu-fp32-64" and fp32.argv[fp32.argv.index("--dtype") + 1] == "float32"
    monkeypatch.setattr("paceline.bench.peers.hf_folder", lambda m: (_ for _ in ()).throw(OSError("disk full")))
    assert "disk full" in vllm_cpu_system("m.gguf").skip


def test_server_autogroup_nice(tmp_path):
    """A server's session gets the autogroup nice asked for (what every process it starts shares); a bad value is a
    ValueError before anything starts."""
    from pathlib import Path

    from paceline.bench.peers import set_autogroup_nice
    if not Path("/proc/self/autogroup").exists():
        pytest.skip("no scheduler autogroups on this kernel")
    system = System("fake", [sys.executable, FAKE, "{port}"], startup_timeout_s=60)
    with Server(system, tmp_path / "fake.log", autogroup_nice=5) as srv:  # a positive nice needs no privilege
        assert Path(f"/proc/{srv.proc.pid}/autogroup").read_text().split()[-1] == "5"
    with pytest.raises(ValueError, match="-20..19"):
        set_autogroup_nice(1, 40)


def test_a_server_inherits_its_callers_autogroup_nice(tmp_path):
    """A harness run at the lowest priority (setsid + autogroup 19) must not put its server, in a session of its own,
    back at nice 0 beside a timed benchmark: unless told otherwise the server gets the caller's autogroup nice."""
    from paceline.bench.peers import own_autogroup_nice
    if own_autogroup_nice() is None:
        pytest.skip("no scheduler autogroups on this kernel")
    srv = Server(System("fake", [sys.executable, FAKE, "{port}"]), tmp_path / "fake.log")
    assert srv.autogroup_nice == own_autogroup_nice()
