"""The package works as a built wheel, not only as an editable checkout: workloads, the prompt corpus and the
simulator's model configs are package data.

The wheel is built from a copy of the source and installed with --no-deps into a fresh venv that borrows this
venv's site-packages for its dependencies (a .pth line: torch is not downloaded again). Every command runs from a
folder outside the checkout, so nothing of the source tree can stand in for what the wheel lacks.
"""
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "bench"))
from fake_server import FakeServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """bin/ of a fresh venv with the wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "paceline", src / "paceline", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(src)], check=True, cwd=tmp)
    wheel = next((tmp / "dist").glob("paceline-*.whl"))
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # this venv's packages after the new venv's own, as a plain path: its .pth files (the editable install of
    # the checkout) stay unread
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, cwd=tmp)
    return env_dir / "bin"


def run(bin_dir: Path, *args: str, cwd: Path) -> str:
    done = subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_wheel_holds_its_data_and_imports_from_the_venv(installed, tmp_path):
    out = run(installed, "python", "-c", "import paceline, pathlib; p = pathlib.Path(paceline.__file__).parent; "
              "print(p); print(sorted(x.name for x in (p / 'bench/data/workloads').glob('*.yaml'))); "
              "print((p / 'bench/data/corpus.txt').stat().st_size > 0, len(list((p / 'sim/configs').glob('*.json'))))",
              cwd=tmp_path)
    where, workloads, data = out.splitlines()
    assert Path(where).is_relative_to(installed.parent) and not Path(where).is_relative_to(ROOT)
    assert workloads == str(["arxiv.yaml", "bursty-priority.yaml", "chat.yaml", "long-prompt.yaml", "quote.yaml",
                             "sharegpt.yaml", "two-tenants.yaml"])
    assert data == "True 5"


def test_paceline_simulate_and_serve_help_from_the_wheel(installed, tmp_path):
    out = run(installed, "paceline", "simulate", "--workload", "sharegpt", "--model-config", "llama-3-8b", "--rate", "2",
              "--num-requests", "20", "--out", str(tmp_path / "sim.json"), cwd=tmp_path)
    assert "20/20 requests finished" in out
    assert (tmp_path / "sim.json").stat().st_size > 0
    assert "--scheduler" in run(installed, "paceline", "serve", "--help", cwd=tmp_path)


def test_one_request_bench_serve_from_the_wheel(installed, tmp_path):
    with FakeServer(ttft=0.05, gap=0.01) as srv:
        out = run(installed, "paceline", "bench", "serve", "--url", srv.url, "--workload", "chat", "--num-requests", "1",
                  "--no-progress", "--output-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert "| 1/1 |" in out
    assert (tmp_path / "out" / "results.json").stat().st_size > 0 and (tmp_path / "out" / "tbt_cdf.png").exists()


def test_paceline_serve_from_the_wheel(installed, tmp_path):
    """The server starts from the wheel (the bundled model found through its package) and answers."""
    import httpx

    from paceline.bench.peers import Server, System
    argv = [str(installed / "paceline"), "--log-level", "WARNING", "serve", "--port", "{port}",
            "--kv-cache-memory-gb", "0.25"]
    with Server(System("paceline-wheel", argv), tmp_path / "serve.log") as srv:
        model = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": model, "prompt": "The sky is", "max_tokens": 2},
                       timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
