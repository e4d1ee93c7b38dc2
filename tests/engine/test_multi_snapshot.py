"""Runtime snapshots (loader.build_model): a GGUF's model as built, mapped back with no conversion; the loader
thread's preparation of a model loaded on demand (map_in, deferred packing; warm_up only for an A/B)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from _tiny_checkpoints import tiny_checkpoint, write_gguf

from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.engine.engine import Engine
from paceline.engine.residency import _build_engine, model_tensors, unpacked_linears, warm_up
from paceline.model import llama, loader
from paceline.sampling import SamplingParams

PROMPTS = ["the cat sat on", "hello there, in the", "a b c d e f"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    # a fresh cache for converted folders and snapshots; the compiled kernels are shared (a build takes ~15 s)
    kernels = loader.cache_root() / "kernels"
    (tmp_path / "cache").mkdir()
    if kernels.is_dir():
        (tmp_path / "cache" / "kernels").symlink_to(kernels)
    monkeypatch.setenv("PACELINE_CACHE", str(tmp_path / "cache"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def gguf(tmp_path) -> str:
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_checkpoint("llama", tie=True, seed=3), path)
    return str(path)


def config(path: str, **kw) -> EngineConfig:
    return EngineConfig(model=path, tbt_goal_ms=0, cache=CacheConfig(num_blocks=64, block_size=4, swap_space_gb=0),
                        scheduler=SchedulerConfig(max_num_batched_tokens=16), **kw)


def greedy(engine: Engine) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(PROMPTS))]


def packing(model) -> list[tuple[str, bool]]:
    """Which of the model's Linears (and their wide or dense copies) hold a packed weight, in a fixed order."""
    out = []
    for i, layer in enumerate(model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            for part in (lin, getattr(lin, "wide", None), getattr(lin, "dense", None)):
                if isinstance(part, llama.Linear):
                    out.append((f"{i}.{name}", part.packed is not None))
    for part in (model.lm_head, model.lm_head.wide):
        if part is not None:
            out.append(("lm_head", part.packed is not None))
    return out


def no_conversion(monkeypatch) -> None:
    def fail(*a, **k):
        raise AssertionError("the model was converted again instead of read from its snapshot")
    monkeypatch.setattr(llama.LlamaModel, "from_weights", fail)


@pytest.mark.parametrize("mode", [dict(dtype="float32"), dict(dtype="bfloat16"),
                                  dict(dtype="bfloat16", quantization="int4")], ids=["fp32", "bf16", "int4"])
def test_second_load_maps_the_snapshot_and_decodes_the_same(gguf, mode, monkeypatch):
    first = Engine(config(gguf, **mode))  # converts, writes the snapshot
    ckpt = loader.load_checkpoint(gguf, "float32" if "quantization" in mode else mode["dtype"])
    reference = llama.LlamaModel.from_weights(ckpt.arch, ckpt.weights, dtype=loader.DTYPES[mode["dtype"]],
                                              quantization=mode.get("quantization", "none"))
    path = loader.snapshot_path(gguf, first.config.dtype, first.config.quantization, first.config.wide_linears)
    assert path is not None and path.is_file()
    expected = greedy(first)
    no_conversion(monkeypatch)
    second = Engine(config(gguf, **mode))
    assert greedy(second) == expected
    # packed as a normal build packs (a bf16 weight does not pack on a CPU without native bf16 math)
    assert packing(second.runner.model) == packing(reference)


def test_snapshot_tensors_come_back_equal_mapped_and_sharing_their_storage(tmp_path, monkeypatch):
    """Plain tensors are stored as loader._rebuild_mapped of their storage (not torch's _rebuild_tensor_v2, whose
    fake-mode check cost ~0.1 ms a tensor); anything else (a Parameter) pickles as torch pickles it. Views still
    share their storage, and the storage is mapped from the file."""
    base = torch.arange(12, dtype=torch.float32).view(3, 4)
    model = {"base": base, "view": base[:, 1:], "codes": torch.arange(8, dtype=torch.uint8),
             "bf16": torch.full((3,), 1.5, dtype=torch.bfloat16), "param": torch.nn.Parameter(torch.ones(2))}
    path = tmp_path / "model.pt"
    loader.write_snapshot(model, path)
    rebuilt = []
    real = loader._rebuild_mapped
    monkeypatch.setattr(loader, "_rebuild_mapped", lambda *a: rebuilt.append(a[-1]) or real(*a))
    back = loader.read_snapshot(path)
    # the Parameter pickles as torch's _rebuild_parameter of its data, a plain tensor: that one is ours too
    assert sorted(map(str, rebuilt)) == sorted(map(str, [torch.float32] * 3 + [torch.uint8, torch.bfloat16]))
    for name, t in model.items():
        assert torch.equal(back[name], t) and back[name].dtype == t.dtype and back[name].stride() == t.stride(), name
    assert isinstance(back["param"], torch.nn.Parameter)
    assert back["view"].untyped_storage().data_ptr() == back["base"].untyped_storage().data_ptr()
    assert mapped_from(back["base"].data_ptr()) == str(path)  # mapped from the file, not read into memory


def test_unpickling_and_mapping_break_inside_a_load_every_tick(tmp_path, monkeypatch):
    """In a load on demand (piece_breaks), a snapshot's unpickling may pause before each tensor and the mapping
    after each madvise part (loader.piece_tick) once the piece has run PIECE_TICK_S; with the tick off or long,
    neither breaks."""
    from paceline.engine import residency

    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    for p in model.parameters():
        p.requires_grad_(False)
    path = tmp_path / "model.pt"
    loader.write_snapshot(model, path)
    monkeypatch.setattr(residency, "MAP_IN_CALL_BYTES", 4096)  # a page a call: each 16 KB weight in 4-5 parts
    madvise, calls = residency.madvise_function(), []
    monkeypatch.setattr(residency, "madvise_function", lambda: lambda *a: calls.append(a) or madvise(*a))
    breaks = []
    for tick_s, ticks in ((1e-9, True), (0.0, False), (3600.0, False)):
        monkeypatch.setattr(loader, "PIECE_TICK_S", tick_s)
        breaks.clear()
        calls.clear()
        with loader.piece_breaks(lambda: breaks.append(1)):
            back = loader.read_snapshot(path)
            after_read = len(breaks)
            residency.map_in(back)
        assert len(calls) >= 12  # the biases (256 bytes) are under a page: not mapped
        # six tensors (3 weights, 3 biases) unpickled, a break after each madvise part
        assert (after_read, len(breaks) - after_read) == ((6, len(calls)) if ticks else (0, 0)), tick_s
        for a, b in zip(back.parameters(), model.parameters()):
            assert torch.equal(a, b)


def mapped_from(address: int) -> str | None:
    """The file the memory at `address` is mapped from (Linux's /proc/self/maps), None if anonymous."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return rest[4] if len(rest) == 5 else None
    return None

def test_snapshot_key_follows_the_mode_and_the_file(gguf, tmp_path):
    a = loader.snapshot_path(gguf, "float32", "none", "auto")
    assert a != loader.snapshot_path(gguf, "bfloat16", "none", "auto")
    assert a != loader.snapshot_path(gguf, "bfloat16", "int4", "auto")
    assert loader.snapshot_path(gguf, "float32", "none", "int8") is None  # fbgemm weights do not map
    other = tmp_path / "other.gguf"
    write_gguf(tiny_checkpoint("llama", tie=True, seed=4), other)
    assert loader.snapshot_path(str(other), "float32", "none", "auto") != a
    folder = tmp_path / "hf"
    loader.write_hf_folder(tiny_checkpoint("llama", seed=4), folder)
    assert loader.snapshot_path(str(folder), "float32", "none", "auto") is None  # no conversion to save


def test_a_broken_snapshot_is_rebuilt(gguf):
    expected = greedy(Engine(config(gguf, dtype="float32")))
    path = loader.snapshot_path(gguf, "float32", "none", "auto")
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    with pytest.warns(UserWarning, match="cannot be read"):
        engine = Engine(config(gguf, dtype="float32"))
    assert greedy(engine) == expected
    assert path.stat().st_size > 1000  # written again


def test_loader_thread_build_from_snapshot_serves_unpacked_then_packed(gguf, monkeypatch):
    monkeypatch.setenv("PACELINE_W4A8_LINEARS", "")  # the float32 copies whose packing is deferred (the op has none)
    # the int4 op on every short step: with the AMX op from 7 rows, the second greedy pass (prefix-cache hits, fewer
    # rows a step) would take another product than the first, which is not what this test is about
    monkeypatch.setenv("PACELINE_INT4_AMX", "0")
    expected = greedy(Engine(config(gguf, dtype="bfloat16", quantization="int4")))
    no_conversion(monkeypatch)
    engine, _ = _build_engine(config(gguf, dtype="bfloat16", quantization="int4"))  # deferred, mapped
    linears = unpacked_linears(engine)
    assert linears and all(lin.packed is None for lin in linears)
    assert not getattr(llama._defer, "on", False)  # the deferral ends with the build
    # the model's tensors are the snapshot file's pages, not a copy
    path = loader.snapshot_path(gguf, "bfloat16", "int4", "auto")
    spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in open("/proc/self/maps")
             if line.rstrip().endswith(str(path))]
    ptrs = [t.untyped_storage().data_ptr() for t in model_tensors(engine.runner.model)]
    assert spans and all(any(a <= p < b for a, b in spans) for p in ptrs if p)
    assert greedy(engine) == expected
    warm_up(engine.runner.model)  # the A/B's old path (PACELINE_LOAD_WARM_UP=1) writes only its scratch cache
    assert greedy(engine) == expected
    for lin in linears:
        lin.packed = llama.Linear._pack(lin.weight, lin.bias)
    assert greedy(engine) == expected


def test_prune_keeps_the_most_recently_used_snapshots(tmp_path):
    import os

    from paceline.model.loader import prune_snapshots

    tmp_path = tmp_path / "snapshots"
    tmp_path.mkdir()
    files = []
    for i in range(5):  # older first
        f = tmp_path / f"{i}.pt"
        f.write_bytes(b"x")
        os.utime(f, (1000 + i, 1000 + i))
        files.append(f)
    os.utime(files[0], (2000, 2000))  # the oldest file was just read: used most recently
    (tmp_path / ".9.pt-tmp").write_bytes(b"x")  # a write in progress is not a snapshot
    removed = prune_snapshots(tmp_path, keep=3, spare=files[1])
    assert sorted(f.name for f in removed) == ["2.pt", "3.pt"]
    assert sorted(f.name for f in tmp_path.iterdir()) == [".9.pt-tmp", "0.pt", "1.pt", "4.pt"]
    assert prune_snapshots(tmp_path / "missing") == []
