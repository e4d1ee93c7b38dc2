"""Workloads: when requests arrive, how long their prompts and outputs are, and at which priority.

A workload is a `WorkloadSpec` (usually read from paceline/bench/data/workloads/<name>.yaml) turned into a list of
`RequestSpec` by `generate`. Generation is deterministic for a seed, and the arrival process, the lengths
and the priority classes draw from separate random streams, so the same seed at a different rate gives the
same requests with their arrival times rescaled: runs at different rates differ only in load.

YAML shape (every key optional except where noted):

    name: chat
    arrival: {kind: poisson}            # poisson | gamma (cv: 3) | fixed | all-at-once | trace
    prompt_tokens: {kind: lognormal, median: 300, sigma: 0.8, min: 16, max: 1500}
    output_tokens: {kind: uniform, min: 50, max: 150}
    classes:                            # a priority mix; without it every request has priority 0
      - {fraction: 0.2, priority: 0, prompt_tokens: {...}, output_tokens: {...}}
      - {fraction: 0.8, priority: 10, prompt_tokens: {...}, output_tokens: {...}}
    # a class may also name its client (sent as the OpenAI `user` field) and cap that client's requests in flight:
    #   - {fraction: 0.9, priority: 0, client: heavy, max_in_flight: 16, ...}
    # a capped client sends a request at its arrival or when one of its own finishes, whichever is later, and
    # what it still holds when the last arrival of the run is due is never sent (a closed loop over the window)
    trace: path/to/trace.csv            # arrival_s,prompt_tokens,output_tokens[,priority]; relative to the yaml
    max_model_len: 8192                 # prompt + output are clipped to it
    prompt_style: text                  # text: a corpus passage; quote: the passage, then its start again, so the
                                        # answer goes on quoting the prompt (what speculative decoding gains on)
    spec_acceptance: 0.1                # simulator only: the chance a prompt-lookup proposal is accepted on it
    models:                             # mixed traffic over a several-model server: each request names one
      - {name: smol-fp32, fraction: 0.5}
      - {name: smol-int4, fraction: 0.5}
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

ARRIVAL_KINDS = ("poisson", "gamma", "fixed", "all-at-once", "trace")
LENGTH_KINDS = ("fixed", "uniform", "zipf", "lognormal", "trace")
PROMPT_STYLES = ("text", "quote")
# package data, so an installed wheel has them: chat, long-prompt, bursty-priority for a CPU server, and sharegpt,
# arxiv at datacenter scale for the simulator (numbers and sources in each file)
WORKLOADS_DIR = Path(__file__).resolve().parent / "data" / "workloads"


@dataclass
class LengthDist:
    kind: str = "fixed"
    value: int = 128  # fixed
    min: int = 1  # uniform, zipf, lognormal: the clip range
    max: int = 1024
    median: float = 128.0  # lognormal
    sigma: float = 0.5  # lognormal: std-dev of log(length)
    a: float = 1.2  # zipf exponent: P(k) ~ k^-a over min..max

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"unknown length distribution {self.kind!r}; choose one of {', '.join(LENGTH_KINDS)}")
        if self.kind == "fixed" and self.value < 1:
            raise ValueError(f"fixed length must be >= 1, got {self.value}")
        if self.kind in ("uniform", "zipf", "lognormal") and not 1 <= self.min <= self.max:
            raise ValueError(f"length range needs 1 <= min <= max, got min={self.min} max={self.max}")
        if self.kind == "lognormal" and (self.median <= 0 or self.sigma < 0):
            raise ValueError(f"lognormal needs median > 0 and sigma >= 0, got {self.median}, {self.sigma}")
        if self.kind == "zipf" and self.a <= 0:
            raise ValueError(f"zipf exponent must be > 0, got {self.a}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.min, self.max + 1, size=n)
        if self.kind == "zipf":
            ranks = np.arange(1, self.max - self.min + 2, dtype=np.float64)
            p = ranks ** -self.a
            return self.min + rng.choice(len(ranks), size=n, p=p / p.sum())
        if self.kind == "lognormal":
            x = np.exp(rng.normal(math.log(self.median), self.sigma, size=n))
            return np.clip(np.rint(x), self.min, self.max).astype(np.int64)
        raise ValueError("trace lengths come from the workload's trace file, not from sampling")


@dataclass
class Arrival:
    kind: str = "poisson"
    cv: float = 1.0  # gamma: coefficient of variation of the gaps (1 = Poisson, >1 = bursty)

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"unknown arrival process {self.kind!r}; choose one of {', '.join(ARRIVAL_KINDS)}")
        if self.cv <= 0:
            raise ValueError(f"gamma cv must be > 0, got {self.cv}")

    def unit_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Gaps between arrivals at rate 1 (mean 1); dividing by the rate gives the real gaps."""
        if self.kind == "poisson":
            return rng.exponential(1.0, size=n)
        if self.kind == "gamma":
            shape = 1.0 / (self.cv * self.cv)
            return rng.gamma(shape, 1.0 / shape, size=n)
        if self.kind == "fixed":
            return np.ones(n)
        if self.kind == "all-at-once":
            return np.zeros(n)
        raise ValueError("trace arrivals come from the workload's trace file")


@dataclass
class PriorityClass:
    fraction: float
    priority: int
    prompt_tokens: LengthDist | None = None  # None: the workload's default
    output_tokens: LengthDist | None = None
    client: str = ""  # who sends it (the `user` field); "" for nobody in particular
    max_in_flight: int = 0  # 0: open loop; else the client's requests in flight at most (all its classes share it)

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"class fraction must be in (0, 1], got {self.fraction}")
        if self.max_in_flight < 0:
            raise ValueError(f"max_in_flight must be >= 0, got {self.max_in_flight}")


@dataclass
class ModelShare:
    name: str
    fraction: float

    def __post_init__(self) -> None:
        if not self.name or not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"a model share needs a name and a fraction in (0, 1], got {self.name!r}, {self.fraction}")


@dataclass
class WorkloadSpec:
    name: str = "custom"
    arrival: Arrival = field(default_factory=Arrival)
    prompt_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", value=256))
    output_tokens: LengthDist = field(default_factory=lambda: LengthDist("fixed", value=128))
    classes: list[PriorityClass] = field(default_factory=list)
    trace: str | None = None  # CSV path, used by arrival kind "trace" and length kind "trace"
    max_model_len: int = 8192
    prompt_style: str = "text"
    spec_acceptance: float = 0.0

    models: list[ModelShare] = field(default_factory=list)  # empty: every request goes to the endpoint's model

    def __post_init__(self) -> None:
        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(f"prompt_style must be one of {', '.join(PROMPT_STYLES)}, got {self.prompt_style!r}")
        if not 0.0 <= self.spec_acceptance <= 1.0:
            raise ValueError(f"spec_acceptance must be in [0, 1], got {self.spec_acceptance}")
        if self.models and not math.isclose(sum(m.fraction for m in self.models), 1.0, abs_tol=1e-6):
            raise ValueError(f"model fractions must sum to 1, got {sum(m.fraction for m in self.models)}")
        if self.classes and not math.isclose(sum(c.fraction for c in self.classes), 1.0, abs_tol=1e-6):
            raise ValueError(f"priority class fractions must sum to 1, got {sum(c.fraction for c in self.classes)}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        uses_trace = self.arrival.kind == "trace" or "trace" in (self.prompt_tokens.kind, self.output_tokens.kind)
        if uses_trace and not self.trace:
            raise ValueError("a trace arrival or length needs `trace: <csv path>`")

    def in_flight_caps(self) -> dict[str, int]:
        """client -> the most requests it keeps in flight, for the clients that cap it."""
        return {c.client: c.max_in_flight for c in self.classes if c.max_in_flight}


@dataclass
class RequestSpec:
    index: int
    arrival_s: float  # seconds after the start of the run
    prompt_tokens: int
    output_tokens: int
    priority: int = 0
    client: str = ""
    model: str | None = None  # None: the endpoint's model


@dataclass
class TraceRow:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    priority: int = 0


def read_trace(path: str | Path) -> list[TraceRow]:
    """CSV of `arrival_s,prompt_tokens,output_tokens[,priority]`, with or without that header line."""
    rows = []
    with open(path, newline="") as f:
        for i, rec in enumerate(csv.reader(f)):
            if not rec or rec[0].strip().startswith("#"):
                continue
            if i == 0 and not _is_number(rec[0]):
                continue  # header
            if len(rec) < 3:
                raise ValueError(f"{path}:{i + 1}: need arrival_s,prompt_tokens,output_tokens[,priority], got {rec}")
            try:
                row = TraceRow(float(rec[0]), int(rec[1]), int(rec[2]), int(rec[3]) if len(rec) > 3 and rec[3].strip() else 0)
            except ValueError:
                raise ValueError(f"{path}:{i + 1}: not numbers: {rec}") from None
            if row.arrival_s < 0 or row.prompt_tokens < 1 or row.output_tokens < 1:
                raise ValueError(f"{path}:{i + 1}: need arrival_s >= 0 and lengths >= 1, got {rec}")
            rows.append(row)
    if not rows:
        raise ValueError(f"trace {path} has no rows")
    rows.sort(key=lambda r: r.arrival_s)
    return rows


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def clip_to_context(prompt_tokens: int, output_tokens: int, max_model_len: int) -> tuple[int, int]:
    """Keep prompt + output within the context: the output is kept whole when it fits, the prompt shrinks."""
    output_tokens = max(1, min(output_tokens, max_model_len - 1))
    prompt_tokens = max(1, min(prompt_tokens, max_model_len - output_tokens))
    return prompt_tokens, output_tokens


def generate(spec: WorkloadSpec, *, rate: float | None = None, num_requests: int | None = None,
             duration_s: float | None = None, seed: int = 0) -> list[RequestSpec]:
    """The requests of one run. Give num_requests, or duration_s (requests arriving before it), or both (whichever
    ends first). Trace arrivals ignore the rate unless it is given, in which case the trace is rescaled to it."""
    if rate is not None and rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if duration_s is not None and duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    trace = read_trace(spec.trace) if spec.trace else None
    if num_requests is None and duration_s is None:
        if trace is None:
            raise ValueError("give num_requests or a duration")
        num_requests = len(trace)
    if spec.arrival.kind not in ("all-at-once", "trace") and rate is None:
        raise ValueError(f"{spec.arrival.kind} arrivals need a rate")
    if spec.arrival.kind == "all-at-once" and num_requests is None:
        raise ValueError("all-at-once arrivals need num_requests")

    arrivals = _arrivals(spec, trace, rate, num_requests, duration_s, seed)
    n = len(arrivals)
    if n == 0:
        raise ValueError("the workload has no requests (duration shorter than the first arrival?)")
    # separate streams: lengths and classes do not depend on the rate or the arrival process
    class_rng = np.random.default_rng([seed, 1])
    prompt_rng = np.random.default_rng([seed, 2])
    output_rng = np.random.default_rng([seed, 3])

    if spec.classes:
        fractions = np.array([c.fraction for c in spec.classes])
        which = class_rng.choice(len(spec.classes), size=n, p=fractions / fractions.sum())
    else:
        which = np.zeros(n, dtype=np.int64)
    prompt = _lengths(spec, trace, n, which, "prompt_tokens", prompt_rng)
    output = _lengths(spec, trace, n, which, "output_tokens", output_rng)
    if trace is not None and not spec.classes:
        priority = [trace[i % len(trace)].priority for i in range(n)]
    else:
        priority = [spec.classes[k].priority if spec.classes else 0 for k in which]
    client = [spec.classes[k].client if spec.classes else "" for k in which]

    models: list[str | None] = [None] * n
    if spec.models:  # its own stream too: adding a model mix changes no arrival, length or priority
        fractions = np.array([m.fraction for m in spec.models])
        picks = np.random.default_rng([seed, 4]).choice(len(spec.models), size=n, p=fractions / fractions.sum())
        models = [spec.models[k].name for k in picks]
    out = []
    for i in range(n):
        p, o = clip_to_context(int(prompt[i]), int(output[i]), spec.max_model_len)
        out.append(RequestSpec(i, float(arrivals[i]), p, o, int(priority[i]), client[i], models[i]))
    return out


def _arrivals(spec: WorkloadSpec, trace: list[TraceRow] | None, rate: float | None, num_requests: int | None,
              duration_s: float | None, seed: int) -> np.ndarray:
    if spec.arrival.kind == "trace":
        times = np.array([r.arrival_s for r in trace])
        times -= times[0]
        if rate is not None and len(times) > 1 and times[-1] > 0:
            times *= (len(times) - 1) / times[-1] / rate  # rescale so the mean rate is `rate`
        if num_requests is not None and num_requests > len(times):
            raise ValueError(f"the trace has {len(times)} requests, asked for {num_requests}")
    else:
        rng = np.random.default_rng([seed, 0])
        if num_requests is not None:
            n = num_requests
        else:  # enough gaps to pass the duration with overwhelming probability; cut below
            n = max(16, int(duration_s * (rate or 1.0) * 3 + 50))
        gaps = spec.arrival.unit_gaps(rng, n) / (rate or 1.0)
        times = np.cumsum(gaps) - gaps[0]  # first request at t=0
    if num_requests is not None:
        times = times[:num_requests]
    if duration_s is not None:
        times = times[times < duration_s]
    return times


def _lengths(spec: WorkloadSpec, trace: list[TraceRow] | None, n: int, which: np.ndarray, key: str,
             rng: np.random.Generator) -> np.ndarray:
    default: LengthDist = getattr(spec, key)
    dists = [getattr(c, key) or default for c in spec.classes] or [default]
    out = np.zeros(n, dtype=np.int64)
    for k, dist in enumerate(dists):
        mask = which == k
        if dist.kind == "trace":
            values = np.array([getattr(trace[i % len(trace)], key) for i in range(n)])
            out[mask] = values[mask]
        else:
            # draw for every request so a class's lengths do not depend on the other classes' draws
            out[mask] = dist.sample(rng, n)[mask]
    return out


# ---- YAML ----

def _length_from(d: dict | None, default: LengthDist | None = None) -> LengthDist | None:
    if d is None:
        return default
    if not isinstance(d, dict):
        raise ValueError(f"a length distribution is a mapping like {{kind: uniform, min: 1, max: 9}}, got {d!r}")
    return LengthDist(**d)


def spec_from_dict(d: dict, base_dir: Path | None = None) -> WorkloadSpec:
    known = {"name", "arrival", "prompt_tokens", "output_tokens", "classes", "trace", "max_model_len", "description",
             "prompt_style", "spec_acceptance",
             "models"}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown workload keys: {', '.join(sorted(unknown))}")
    trace = d.get("trace")
    if trace and base_dir is not None and not Path(trace).is_absolute():
        trace = str(base_dir / trace)
    classes = [PriorityClass(fraction=c["fraction"], priority=c.get("priority", 0),
                             prompt_tokens=_length_from(c.get("prompt_tokens")),
                             output_tokens=_length_from(c.get("output_tokens")),
                             client=str(c.get("client", "")), max_in_flight=int(c.get("max_in_flight", 0)))
               for c in d.get("classes") or []]
    return WorkloadSpec(
        name=d.get("name", "custom"),
        arrival=Arrival(**(d.get("arrival") or {})),
        prompt_tokens=_length_from(d.get("prompt_tokens"), LengthDist("fixed", value=256)),
        output_tokens=_length_from(d.get("output_tokens"), LengthDist("fixed", value=128)),
        classes=classes,
        trace=trace,
        max_model_len=int(d.get("max_model_len", 8192)),
        prompt_style=d.get("prompt_style", "text"),
        spec_acceptance=float(d.get("spec_acceptance", 0.0)),
        models=[ModelShare(str(m["name"]), float(m["fraction"])) for m in d.get("models") or []],
    )


def load_workload(name_or_path: str, **overrides) -> WorkloadSpec:
    """A named workload (`chat`, see WORKLOADS_DIR), a YAML path, or a trace CSV path."""
    path = Path(name_or_path)
    if path.suffix == ".csv":
        spec = WorkloadSpec(name=path.stem, arrival=Arrival("trace"), prompt_tokens=LengthDist("trace"),
                            output_tokens=LengthDist("trace"), trace=str(path))
    else:
        if not path.exists():
            path = WORKLOADS_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            names = sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))
            raise ValueError(f"no workload {name_or_path!r}: not a file, and not one of {', '.join(names)}")
        spec = spec_from_dict(yaml.safe_load(path.read_text()) or {}, path.parent)
    return replace(spec, **{k: v for k, v in overrides.items() if v is not None})
