"""ModelArch: the shapes of a Llama-family model, read from a Hugging Face config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field

# Hugging Face `architectures` / `model_type` values that share the Llama layer layout
SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelArch:
    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # as in config.json: {"rope_type": "llama3" | "linear" | ..., ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArch":
        archs = cfg.get("architectures") or []
        name = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
        if name is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; paceline runs {', '.join(SUPPORTED)}"
            )
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes rope settings as `rope_parameters` instead of rope_theta / rope_scaling
        rope = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        hidden = cfg["hidden_size"]
        return cls(
            architecture=name,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", name == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )
