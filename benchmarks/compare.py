"""Side-by-side benchmark: paceline's schedulers, llama.cpp's llama-server and `transformers serve`.

    python benchmarks/compare.py --workload chat
    python benchmarks/compare.py --workload long-prompt --systems paceline-sarathi,paceline-vllm --no-capacity --rates 0.2,0.4

Same as `paceline bench compare ...`; see `--help` for the knobs (probe sizes, budgets, SLOs).
"""
import argparse
import sys

from paceline.bench.compare import add_compare_args

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="benchmarks/compare.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_compare_args(parser)
    args = parser.parse_args()
    sys.exit(args.func(args))
