"""Tiny random checkpoints for loader and tokenizer tests, written the way real tools write them.

write_gguf follows llama.cpp's converter: tensor names, metadata keys, and the q/k row permutation it
applies to rotary-NORM architectures (llama, mistral), so the loader's inverse is checked against it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer as BackendTokenizer, decoders, models, pre_tokenizers

from paceline.model.arch import ModelArch
from paceline.model.loader import Checkpoint, expected_weight_names
from paceline.model.tokenizer import Tokenizer, _byte_alphabet

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE: the 3 specials, 256 byte tokens and a few merges."""
    alphabet = _byte_alphabet()
    tokens = SPECIALS + [alphabet[b] for b in range(256)]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    tokens += [a + b for a, b in merges]
    backend = BackendTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return Tokenizer(backend, bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=CHATML)


def tiny_arch(kind: str = "llama", tie: bool = False, vocab_size: int = 264) -> ModelArch:
    return ModelArch(architecture=kind, vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=256, tie_word_embeddings=tie, attention_bias=kind == "qwen2",
                     bos_token_id=1, eos_token_id=2)


def tiny_checkpoint(kind: str = "llama", tie: bool = False, seed: int = 0) -> Checkpoint:
    tok = tiny_tokenizer()
    arch = tiny_arch(kind, tie, tok.vocab_size)
    g = torch.Generator().manual_seed(seed)
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    shapes = {"embed_tokens": (arch.vocab_size, h), "lm_head": (arch.vocab_size, h), "q_proj.weight": (q, h),
              "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q), "q_proj.bias": (q,),
              "k_proj.bias": (kv,), "v_proj.bias": (kv,), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
              "norm": (h,), "layernorm": (h,)}
    weights = {}
    for name in expected_weight_names(arch):
        shape = next(s for k, s in shapes.items() if k in name)
        weights[name] = torch.randn(shape, generator=g) * 0.2 + (1.0 if "norm" in name else 0.0)
    return Checkpoint(arch, weights, tok, f"tiny-{kind}", "memory")


# llama.cpp names: Hugging Face suffix → GGUF suffix
_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
            "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
            "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
            **{f"self_attn.{p}_proj.{w}": f"attn_{p}.{w}" for p in "qkv" for w in ("weight", "bias")}}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row order llama.cpp's converter gives q and k for its rotary layout (convert_hf_to_gguf's permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(ckpt: Checkpoint, path: Path, gguf_arch: str | None = None, pre: str = "default",
               quantize: str | None = None, drop: tuple[str, ...] = ()) -> Path:
    """Write `ckpt` as llama.cpp would. quantize="Q8_0" stores the 2-D matrices quantized."""
    import gguf

    arch, tok = ckpt.arch, ckpt.tokenizer
    gguf_arch = gguf_arch or arch.architecture
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_string(f"{gguf_arch}.placeholder", "")  # harmless extra key, as real files have many
    w.add_uint32(f"{gguf_arch}.block_count", arch.num_layers)
    w.add_uint32(f"{gguf_arch}.context_length", arch.max_position_embeddings)
    w.add_uint32(f"{gguf_arch}.embedding_length", arch.hidden_size)
    w.add_uint32(f"{gguf_arch}.feed_forward_length", arch.intermediate_size)
    w.add_uint32(f"{gguf_arch}.attention.head_count", arch.num_heads)
    w.add_uint32(f"{gguf_arch}.attention.head_count_kv", arch.num_kv_heads)
    w.add_float32(f"{gguf_arch}.rope.freq_base", arch.rope_theta)
    w.add_float32(f"{gguf_arch}.attention.layer_norm_rms_epsilon", arch.rms_norm_eps)
    w.add_uint32(f"{gguf_arch}.rope.dimension_count", arch.head_dim)
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "i n", "Ġ a"])
    w.add_uint32("tokenizer.ggml.bos_token_id", vocab[tok.bos_token])
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab[tok.eos_token])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", tok.chat_template)
    permuted = gguf_arch in ("llama", "mistral")
    for name, t in ckpt.weights.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_TO_GGUF[rest]}"
        if gname in drop:
            continue
        a = t.float().numpy()
        if permuted and ".attn_q." in gname:
            a = llama_cpp_permute(a, arch.num_heads)
        elif permuted and ".attn_k." in gname:
            a = llama_cpp_permute(a, arch.num_kv_heads)
        if quantize and a.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quantize]
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
