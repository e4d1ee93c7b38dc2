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
