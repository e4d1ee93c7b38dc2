"""Model shapes for simulated deployments: Hugging Face config.json fields, turned into ModelArch."""
from __future__ import annotations

import json
from pathlib import Path

from paceline.model.arch import ModelArch

CONFIG_DIR = Path(__file__).parent / "configs"


def list_model_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_model_config(name_or_path: str) -> ModelArch:
    """A bundled name (mistral-7b, llama-3-8b, ...) or a path to any config.json."""
    path = Path(name_or_path)
    if not path.is_file():
        path = CONFIG_DIR / f"{name_or_path.lower()}.json"
    if not path.is_file():
        raise ValueError(f"unknown model config {name_or_path!r}; choose one of {', '.join(list_model_configs())} or give a config.json path")
    return ModelArch.from_hf_config(json.loads(path.read_text()))


def num_parameters(arch: ModelArch) -> int:
    """Weights of the transformer (attention, MLP, norms) plus embeddings and LM head."""
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    attn = arch.hidden_size * (q + 2 * kv) + q * arch.hidden_size
    if arch.attention_bias:
        attn += q + 2 * kv
    mlp = 3 * arch.hidden_size * arch.intermediate_size
    layer = attn + mlp + 2 * arch.hidden_size
    embed = arch.vocab_size * arch.hidden_size
    head = 0 if arch.tie_word_embeddings else embed
    return arch.num_layers * layer + embed + head + arch.hidden_size
