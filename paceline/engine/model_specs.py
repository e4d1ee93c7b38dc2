"""The models one server may serve: names, paths, numeric modes, KV memory, keep-alive, pinning.

Given as `--model NAME=PATH` (repeatable; a bare `--model PATH` is one model under its own name) or as a YAML file
(`--models-config`):

    models:
      - name: smol-fp32
        path: null                 # null: the bundled SmolLM2-135M-Instruct
        dtype: float32
        kv_cache_memory_gb: 0.25
        pinned: true               # never evicted
      - name: smol-int4
        quantization: int4
        keep_alive: 5m             # Ollama's spelling: 30s, 5m, 1h, a number of seconds, 0, or negative = forever
        load: lazy                 # lazy: loaded by its first request; eager (default): at start-up
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paceline.config import EngineConfig

FOREVER = math.inf
_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_keep_alive(value: Any) -> float:
    """Seconds a model stays loaded after its last request, as Ollama spells `keep_alive`: a duration string
    ("30s", "5m", "1h", "1h30m"), a number of seconds, 0 (unload as soon as it is idle) or negative (forever)."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"keep_alive must be a duration such as '5m', a number of seconds, or -1; got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        parts = re.findall(r"(-?\d+(?:\.\d+)?)(ms|h|m|s)", text)
        if parts and "".join(a + b for a, b in parts) == text.replace(" ", ""):  # Go's form: 1h30m, 2m0s
            seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
        else:
            m = _DURATION.match(text)
            if m is None:
                raise ValueError(f"keep_alive {value!r} is not a duration such as '30s', '5m', '1h', or a number of "
                                 "seconds")
            seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if math.isnan(seconds):
        raise ValueError("keep_alive must not be NaN")
    return FOREVER if seconds < 0 else seconds


@dataclass
class ModelSpec:
    name: str
    path: str | None = None  # GGUF file or Hugging Face folder; None: the bundled model
    dtype: str | None = None  # None: the server's --dtype
    quantization: str | None = None  # None: the server's --quantization
    kv_cache_memory_gb: float | None = None  # None: the server's --kv-cache-memory-gb
    num_kv_blocks: int | None = None
    keep_alive: float = FOREVER  # seconds idle before it is unloaded
    pinned: bool = False  # never evicted to make room for another model
    load: str = "eager"  # eager: loaded at start-up (while it fits); lazy: by its first request

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str) or any(c.isspace() for c in self.name):
            raise ValueError(f"a model name must be a non-empty string without spaces, got {self.name!r}")
        if self.load not in ("eager", "lazy"):
            raise ValueError(f"model {self.name}: load must be eager or lazy, got {self.load!r}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"model {self.name}: kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"model {self.name}: num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not isinstance(self.keep_alive, float):
            self.keep_alive = parse_keep_alive(self.keep_alive)

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """The server's settings with this model's own: a fresh copy, since an Engine writes into its config."""
        cache = dataclasses.replace(base.cache)
        if self.kv_cache_memory_gb is not None:
            cache.kv_cache_memory_gb, cache.num_blocks = self.kv_cache_memory_gb, None
        if self.num_kv_blocks is not None:
            cache.num_blocks = self.num_kv_blocks
        scheduler = dataclasses.replace(base.scheduler)
        scheduler.max_step_ms_given = base.scheduler.max_step_ms_given  # init=False: replace() does not carry it
        dtype = self.dtype or base.dtype
        quantization = self.quantization or ("auto" if self.dtype else base.quantization)
        return EngineConfig(model=self.path, dtype=dtype, quantization=quantization, device=base.device,
                            served_model_name=self.name, seed=base.seed, step_profile=base.step_profile,
                            tbt_goal_ms=base.tbt_goal_ms, speculative_config=base.speculative_config, cache=cache,
                            scheduler=scheduler)


def parse_model_flag(value: str) -> ModelSpec:
    """`NAME=PATH` or a bare `PATH` (served under the name the checkpoint gives)."""
    name, sep, path = value.partition("=")
    if sep and name and "/" not in name and not Path(value).exists():
        return ModelSpec(name=name, path=path or None)
    return ModelSpec(name=Path(value).stem or value, path=value)


_SPEC_KEYS = {f.name for f in dataclasses.fields(ModelSpec)}


def load_models_config(path: str | Path) -> list[ModelSpec]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read the models config {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"the models config {path} is not valid YAML: {e}") from None
    items = data.get("models") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise ValueError(f"the models config {path} needs a non-empty list `models:` of {{name, path, ...}}")
    specs = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "name" not in item:
            raise ValueError(f"{path}: model #{i + 1} must be a mapping with at least `name`")
        unknown = set(item) - _SPEC_KEYS
        if unknown:
            raise ValueError(f"{path}: model {item['name']!r} has unknown keys {sorted(unknown)}; known: "
                             f"{sorted(_SPEC_KEYS)}")
        specs.append(ModelSpec(**{k: (str(v) if k == "path" and v is not None else v) for k, v in item.items()}))
    return check_unique(specs)


def check_unique(specs: list[ModelSpec]) -> list[ModelSpec]:
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"two models are named {s.name!r}; each needs its own name")
        seen.add(s.name)
    return specs


def estimate_bytes(config: EngineConfig) -> int:
    """What a model will hold once loaded, before loading it: its weights (parameter count from the file's tensor
    shapes, at the numeric mode's bytes per parameter) plus its KV pool. Only the residency budget's first guess;
    after a load the measured size replaces it."""
    shapes, layers, kv_width = _shapes(config.model)
    params = sum(math.prod(s) for s in shapes)
    dtype = "bfloat16" if config.dtype == "auto" else config.dtype
    elem = 4 if dtype == "float32" else 2
    # int4: 4-bit codes plus a bfloat16 scale and offset per group of 32 (embeddings stay in bfloat16, so over-counted)
    weights = params * (0.5 + 4 / 32) if config.quantization == "int4" else params * elem
    from paceline.engine.engine import resolve_device

    # "auto" is CUDA where torch sees it: on a GPU the estimate once counted these CPU copies too (1.43x a tiny
    # model's measured size, an H200, 2026-11-29)
    if (dtype == "float32" and config.quantization in ("none", "auto")
            and resolve_device(config.device).type == "cpu"):
        from paceline.model import f32_rows_kernel
        if f32_rows_kernel.build_key() == "on":  # the layers' plain weights stay beside the packed ones (llama.Linear)
            vocab = max((max(s) for s in shapes if len(s) == 2), default=0)
            weights += 4 * sum(math.prod(s) for s in shapes if len(s) == 2 and vocab not in s)
    cache = config.cache
    block = layers * 2 * cache.block_size * kv_width * elem
    kv = cache.num_blocks * block if cache.num_blocks else cache.kv_cache_memory_gb * 2**30
    return int(weights + kv)


def _shapes(model: str | None) -> tuple[list[tuple[int, ...]], int, int]:
    """(every tensor's shape, layers, KV heads x head dim) read from a file's header, not its weights."""
    import json

    from paceline.model.loader import converted_folder, default_model_path, read_gguf

    path = Path(model if model is not None else default_model_path()).expanduser()
    if path.is_file():  # a GGUF's converted folder, once written, has the same tensors behind a 0.01 s header
        path = converted_folder(path) or path  # (reading the GGUF's own header parses its vocabulary: 0.2 s)
    if path.is_dir():
        from safetensors import safe_open

        cfg = json.loads((path / "config.json").read_text())
        shapes = []
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                shapes += [tuple(st.get_slice(k).get_shape()) for k in st.keys()]
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return shapes, cfg["num_hidden_layers"], (cfg.get("num_key_value_heads") or heads) * head_dim
    meta, tensors = read_gguf(path)
    arch = meta.get("general.architecture")
    heads = meta.get(f"{arch}.attention.head_count", 1)
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.embedding_length", 0) // heads
    kv_heads = meta.get(f"{arch}.attention.head_count_kv") or heads
    return [t.shape for t in tensors.values()], meta.get(f"{arch}.block_count", 0), kv_heads * head_dim
