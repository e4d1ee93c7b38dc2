import numpy as np
import pytest

from paceline.bench.prompts import PromptSource, build_prompts
from paceline.bench.workload import (Arrival, LengthDist, PriorityClass, WorkloadSpec, clip_to_context, generate,
                                     load_workload, read_trace)


def arrivals(spec, **kw):
    return np.array([r.arrival_s for r in generate(spec, **kw)])


def cv(x):
    return x.std() / x.mean()


def test_poisson_rate_and_cv():
    gaps = np.diff(arrivals(WorkloadSpec(), rate=4.0, num_requests=20000, seed=1))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert cv(gaps) == pytest.approx(1.0, rel=0.05)


def test_gamma_burstiness():
    gaps = np.diff(arrivals(WorkloadSpec(arrival=Arrival("gamma", cv=3.0)), rate=2.0, num_requests=40000, seed=2))
    assert gaps.mean() == pytest.approx(0.5, rel=0.08)
    assert cv(gaps) == pytest.approx(3.0, rel=0.12)


def test_fixed_interval_and_all_at_once():
    t = arrivals(WorkloadSpec(arrival=Arrival("fixed")), rate=5.0, num_requests=6)
    assert t == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert (arrivals(WorkloadSpec(arrival=Arrival("all-at-once")), num_requests=9) == 0).all()


def test_duration_cuts_arrivals():
    t = arrivals(WorkloadSpec(), rate=2.0, duration_s=100.0, seed=3)
    assert t.max() < 100.0 and 150 < len(t) < 250
    t2 = arrivals(WorkloadSpec(), rate=2.0, duration_s=100.0, num_requests=10, seed=3)
    assert len(t2) == 10


def test_seeds_reproduce_and_rates_only_rescale_time():
    spec = load_workload("chat")
    a = generate(spec, rate=1.0, num_requests=50, seed=7)
    b = generate(spec, rate=1.0, num_requests=50, seed=7)
    c = generate(spec, rate=4.0, num_requests=50, seed=7)
    d = generate(spec, rate=1.0, num_requests=50, seed=8)
    assert a == b
    assert [(r.prompt_tokens, r.output_tokens) for r in a] == [(r.prompt_tokens, r.output_tokens) for r in c]
    assert [r.arrival_s / 4 for r in a] == pytest.approx([r.arrival_s for r in c])
    assert [r.prompt_tokens for r in a] != [r.prompt_tokens for r in d]


def test_length_distributions():
    rng = np.random.default_rng(0)
    u = LengthDist("uniform", min=10, max=20).sample(rng, 5000)
    assert u.min() == 10 and u.max() == 20
    ln = LengthDist("lognormal", median=300, sigma=0.8, min=16, max=1500).sample(rng, 20000)
    assert np.median(ln) == pytest.approx(300, rel=0.05)
    assert ln.min() >= 16 and ln.max() <= 1500
    z = LengthDist("zipf", a=1.5, min=5, max=100).sample(rng, 20000)
    assert z.min() == 5 and z.max() <= 100
    counts = np.bincount(z)
    assert counts[5] > counts[6] > counts[10] > counts[50]  # decreasing frequency with rank
    assert (LengthDist("fixed", value=42).sample(rng, 3) == 42).all()


def test_clipping_to_context():
    assert clip_to_context(100, 50, 8192) == (100, 50)
    assert clip_to_context(8000, 500, 8192) == (7692, 500)
    assert clip_to_context(10, 9000, 8192) == (1, 8191)
    spec = WorkloadSpec(prompt_tokens=LengthDist("fixed", value=3000), output_tokens=LengthDist("fixed", value=200),
                        max_model_len=2048)
    r = generate(spec, rate=1.0, num_requests=3)
    assert all(x.prompt_tokens + x.output_tokens == 2048 and x.output_tokens == 200 for x in r)


def test_priority_mix():
    spec = load_workload("bursty-priority")
    rs = generate(spec, rate=1.0, num_requests=4000, seed=0)
    hi = [r for r in rs if r.priority == 0]
    lo = [r for r in rs if r.priority == 10]
    assert len(hi) + len(lo) == len(rs)
    assert len(hi) / len(rs) == pytest.approx(0.2, abs=0.03)
    assert np.median([r.prompt_tokens for r in hi]) < np.median([r.prompt_tokens for r in lo])
    assert max(r.output_tokens for r in hi) <= 64 and min(r.output_tokens for r in lo) >= 100


def test_named_workloads_have_their_shapes():
    chat = generate(load_workload("chat"), rate=1.0, num_requests=3000, seed=0)
    assert np.median([r.prompt_tokens for r in chat]) == pytest.approx(300, rel=0.1)
    assert max(r.prompt_tokens for r in chat) <= 1500
    assert np.median([r.output_tokens for r in chat]) == pytest.approx(100, rel=0.1)
    assert max(r.output_tokens for r in chat) <= 400
    lp = generate(load_workload("long-prompt"), rate=1.0, num_requests=500, seed=0)
    assert all(1000 <= r.prompt_tokens <= 3000 and 50 <= r.output_tokens <= 150 for r in lp)


def test_trace_csv(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("arrival_s,prompt_tokens,output_tokens,priority\n0.5,10,5,1\n1.5,20,6\n2.5,30,7,0\n")
    rows = read_trace(p)
    assert [r.priority for r in rows] == [1, 0, 0]
    spec = load_workload(str(p))
    rs = generate(spec)
    assert [r.arrival_s for r in rs] == pytest.approx([0.0, 1.0, 2.0])
    assert [(r.prompt_tokens, r.output_tokens, r.priority) for r in rs] == [(10, 5, 1), (20, 6, 0), (30, 7, 0)]
    assert [r.arrival_s for r in generate(spec, rate=2.0)] == pytest.approx([0.0, 0.5, 1.0])  # rescaled to 2/s
    bad = tmp_path / "bad.csv"
    bad.write_text("0.5,10\n")
    with pytest.raises(ValueError, match="need arrival_s"):
        read_trace(bad)


def test_yaml_workload_with_trace_lengths_and_poisson_arrivals(tmp_path):
    (tmp_path / "t.csv").write_text("0,11,3\n0,22,4\n")
    y = tmp_path / "w.yaml"
    y.write_text("name: w\narrival: {kind: poisson}\nprompt_tokens: {kind: trace}\noutput_tokens: {kind: fixed, value: 9}\n"
                 "trace: t.csv\n")
    rs = generate(load_workload(str(y)), rate=1.0, num_requests=4)
    assert [r.prompt_tokens for r in rs] == [11, 22, 11, 22] and {r.output_tokens for r in rs} == {9}


@pytest.mark.parametrize("make", [
    lambda: LengthDist("gaussian"),
    lambda: LengthDist("uniform", min=5, max=2),
    lambda: Arrival("weibull"),
    lambda: Arrival("gamma", cv=0),
    lambda: WorkloadSpec(classes=[PriorityClass(0.5, 0), PriorityClass(0.2, 1)]),
    lambda: generate(WorkloadSpec(), rate=-1.0, num_requests=3),
    lambda: generate(WorkloadSpec(), num_requests=3),
    lambda: generate(WorkloadSpec(), rate=1.0),
    lambda: load_workload("no-such-workload"),
])
def test_bad_input_is_a_value_error(make):
    with pytest.raises(ValueError):
        make()


class WordTokenizer:
    """One token per word: enough to check slicing, counts and seeds without a model."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text, add_special_tokens=False):
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        inv = {v: k for k, v in self.vocab.items()}
        return " ".join(inv[i] for i in ids)


def test_prompts_have_exact_lengths_and_are_reproducible():
    source = PromptSource(WordTokenizer(), "the quick brown fox jumps over the lazy dog " * 3)
    reqs = generate(WorkloadSpec(prompt_tokens=LengthDist("uniform", min=1, max=60)), rate=1.0, num_requests=20)
    ids = build_prompts(source, reqs, seed=3, as_text=False)
    assert [len(p) for p in ids] == [r.prompt_tokens for r in reqs]  # longer than the corpus: wraps around
    assert ids == build_prompts(source, reqs, seed=3, as_text=False)
    assert ids != build_prompts(source, reqs, seed=4, as_text=False)
    # a new epoch (the next run against the same server) gets other text of the same lengths: no prefix-cache hits
    other = build_prompts(source, reqs, seed=3, as_text=False, epoch=1)
    assert [len(p) for p in other] == [len(p) for p in ids] and other != ids
    texts = build_prompts(source, reqs, seed=3, as_text=True)
    assert [len(t.split()) for t in texts] == [r.prompt_tokens for r in reqs]


def test_real_corpus_with_the_bundled_tokenizer_round_trips_near_exactly():
    from paceline.bench.prompts import load_tokenizer
    tok = load_tokenizer()
    source = PromptSource(tok)
    assert len(source.ids) > 50_000  # a few hundred KB of prose
    rng = np.random.default_rng(0)
    for n in (50, 300, 1500):
        text = source.text(source.token_ids(n, rng))
        assert abs(len(tok.encode(text, add_special_tokens=False)) - n) <= max(2, n // 100)
