"""Speculative decoding, shown: the embedded model continues a few code prompts twice, greedily,
without and with speculation (default: ngram prompt lookup), on this machine.

It prints the generated text, checks that both runs emitted exactly the same tokens (greedy
speculative decoding is lossless), and compares tokens/s, with the mean acceptance length and
the acceptance by position of the speculative run. Exit status 1 if the outputs differ.

    npuspec demo
    npuspec demo --speculative-config '{"method": "suffix", "num_speculative_tokens": 8}'
    npuspec demo --method eagle3        (eagle, eagle3, medusa, mtp: the embedded heads)
    npuspec demo --model SmolLM2-135M-Instruct.Q4_1.gguf --method eagle3 --prompts open-ended
    npuspec demo --model ~/models/Qwen3-0.6B --prompts prompts.txt --max-tokens 64
    npuspec demo --model SmolLM2-135M-Instruct.Q4_1.gguf --prompts code-edit
"""
from __future__ import annotations

import argparse
import json

from npuspec.cli_util.flags import DEFAULT_SPEC, METHOD_SPECS, add_threads_flag, positive


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help="HF checkpoint directory, or a llama.cpp .gguf file (or a directory holding one) "
                        "(default: the embedded tiny model)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help=f"vllm serve --speculative-config schema, inline JSON or a .json file "
                        f"(default: {json.dumps(DEFAULT_SPEC)})")
    p.add_argument("--method", default=None, choices=sorted(METHOD_SPECS),
                   help="run this method with its default settings: the heads npuspec ships for "
                        "the embedded model, and EAGLE-3's for SmolLM2-135M-Instruct "
                        "(smollm2-eagle3); --speculative-config overrides")
    p.add_argument("--max-tokens", type=positive, default=96, help="new tokens per prompt (default 96)")
    p.add_argument("--prompts", default=None, help="prompt file (.txt one per line, .json list, .jsonl), or "
                                                   "'code-edit' (6 built-in code-editing chat requests), "
                                                   "'open-ended' (24 chat requests); "
                                                   "default: 4 built-in code prompts")
    p.add_argument("--max-num-seqs", type=positive, default=1,
                   help="concurrent requests (default 1: one prompt at a time, the latency view)")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graph capture")
    p.add_argument("--no-text", action="store_true", help="do not print the generated text")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    add_threads_flag(p)


def run(args) -> int:
    from npuspec.cli import demo_run  # heavy: keeps `--help` and flag errors off torch's import
    return demo_run.run(args)
