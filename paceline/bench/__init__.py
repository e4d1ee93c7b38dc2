"""Benchmark harness for any OpenAI-compatible server.

    paceline bench serve --url http://127.0.0.1:8000 --workload chat --rate 1 --duration 60
    paceline bench capacity --url http://127.0.0.1:8000 --workload long-prompt --slo strict,relaxed
    paceline bench compare --workload chat          (same as python benchmarks/compare.py --workload chat)

Modules, one job each:
    workload.py        arrivals, lengths, priority classes -> RequestSpec list (seeded; YAML in data/workloads)
    prompts.py         real text (data/corpus.txt) cut to exact token counts with the model's tokenizer
    client.py          open-loop streaming load generator; one timestamp per output token
    metrics.py         records, TTFT, TBT, TPOT, e2e, normalized latency, stalls, throughput, goodput (architecture.md);
                       the simulator emits these records and reports through this module, report.py and plots.py
    server_metrics.py  /metrics scrapes: scheduling delay histogram, decode vs prompt-chunk tokens over time
    report.py, plots.py  JSON with every sample, markdown tables, PNGs
    capacity.py        SLOs (strict 5x / relaxed 25x), judging a probe, bounded bisection on the rate, capacity over
                       every probe: pure functions of summaries, shared with `paceline simulate capacity`
    calibrate.py       the decode step strict/relaxed scale, a prompt's prefill rate alone
    peers.py           start/stop paceline (each scheduler), llama-server, transformers serve on 127.0.0.1
    host_cpu.py        how busy the host was during a run (/proc): what other processes and the hypervisor took
    compare.py         the side-by-side run; cli.py wires the sub-commands
"""
