"""prompt_logprobs on the bundled model: each prompt token's logprob, rank and top k equal transformers' fp32
log-softmax over the same weights, whether the prompt runs whole or in chunks, beside a request that shares its
prefix (prefix caching must not skip the positions), and requests that do not ask get none."""
from __future__ import annotations

import pytest
import torch

from paceline import LLM, SamplingParams

TOL = 1e-3  # float32 both sides; paged attention sums in another order


@pytest.fixture(scope="module")
def checkpoint():
    loader = pytest.importorskip("paceline.model.loader")
    return loader.load_checkpoint(None, "float32")


@pytest.fixture(scope="module")
def reference(checkpoint):
    transformers = pytest.importorskip("transformers")
    from paceline.model.loader import hf_config

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(checkpoint.arch)))
    hf.load_state_dict(checkpoint.weights, strict=False)
    hf.tie_weights()
    hf.eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


@pytest.mark.parametrize("chunk", [None, 16])
def test_prompt_logprobs_match_transformers(checkpoint, reference, chunk):
    kw = {"max_num_batched_tokens": chunk, "long_prefill_token_threshold": chunk} if chunk else {}
    llm = LLM(dtype="float32", kv_cache_memory_gb=0.05, enable_prefix_caching=True, **kw)
    tok = llm.tokenizer
    shared = "The history of the town of Arden begins with a stone bridge built over the river in 1780, and "
    prompts = [tok.encode(shared + "a mill followed."), tok.encode(shared + "then came the railway station.")]
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    asks = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    first = llm.generate(prompts[0], plain)[0]  # fills the prefix cache the second request could reuse
    assert first.prompt_logprobs is None
    out = llm.generate(prompts[1], asks)[0]
    ids = prompts[1]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    ref = reference(ids)
    for pos in range(1, len(ids)):
        got, want = out.prompt_logprobs[pos], ref[pos - 1]
        assert abs(got.logprob - want[ids[pos]].item()) < TOL, pos
        assert got.rank == int((want > want[ids[pos]]).sum()) + 1 or abs(got.logprob - want.max().item()) < TOL
        top_v, top_i = want.topk(3)
        assert [t for t, _ in got.top] == top_i.tolist() or torch.allclose(
            torch.tensor([v for _, v in got.top]), top_v, atol=TOL)
        assert all(abs(v - want[t].item()) < TOL for t, v in got.top)
