"""Tiny random Llama / Qwen2 / Mistral models built with transformers: weights for paceline and the reference."""
from __future__ import annotations

import pytest
import torch

from paceline.engine.runner import ModelRunner
from paceline.model.arch import ModelArch
from paceline.model.llama import LlamaModel



@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny models gain nothing from a second thread (tests/conftest.py)."""


def make_hf_model(kind: str = "llama", seed: int = 0, **overrides):
    """A randomly initialised tiny transformers model; weights large enough that attention is not uniform."""
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.15,
                  tie_word_embeddings=False)
    common.update(overrides)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[kind]
    if kind == "mistral":
        common.setdefault("sliding_window", None)
    config = cls[0](**common)
    config.architectures = [cls[1].__name__]
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    with torch.no_grad():  # non-trivial norm weights and biases so a mix-up in either shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.3)
    return model


def arch_of(hf_model) -> ModelArch:
    cfg = hf_model.config.to_dict()
    # transformers >= 5 writes rope settings as `rope_parameters`; ModelArch reads the classic fields
    rp = cfg.get("rope_parameters") or {}
    if "rope_theta" in rp:
        cfg["rope_theta"] = rp["rope_theta"]
    if rp.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    return ModelArch.from_hf_config(cfg)


def make_runner(hf_model, num_blocks: int = 64, block_size: int = 4, num_host_blocks: int = 0,
                dtype: torch.dtype = torch.float32, seed: int = 0) -> ModelRunner:
    arch = arch_of(hf_model)
    model = LlamaModel.from_weights(arch, hf_model.state_dict(), "cpu", dtype)
    return ModelRunner(model, arch, num_blocks, block_size, num_host_blocks=num_host_blocks, dtype=dtype, seed=seed)


@pytest.fixture(scope="module")
def hf_llama():
    return make_hf_model("llama")


@pytest.fixture
def runner(hf_llama) -> ModelRunner:
    return make_runner(hf_llama)


class Tiny:
    """The helpers above, handed to tests as a fixture (test modules cannot import a conftest by name)."""
    make_hf_model = staticmethod(make_hf_model)
    make_runner = staticmethod(make_runner)
    arch_of = staticmethod(arch_of)


@pytest.fixture(scope="session")
def tiny() -> type[Tiny]:
    return Tiny
