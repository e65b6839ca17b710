"""Generate text with npuspec's offline engine (`npuspec.LLM`) from an HF checkpoint or a GGUF file.

The continuations go to stdout (prompt included unless --only-new); a one-line summary
(tokens/s, mean acceptance length) goes to stderr.

    npuspec generate --prompt "def fib(n):" --max-tokens 64
    npuspec generate --model ~/models/Qwen3-0.6B --prompt "import os" \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""
from __future__ import annotations

import argparse

from npuspec.cli_util.flags import add_quantization_flag, finite, positive


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help="HF checkpoint directory, or a llama.cpp .gguf file (or a directory holding one) "
                        "(default: the embedded tiny model)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    p.add_argument("--prompts", default=None, help="prompt file (.txt one per line, .json list, .jsonl), "
                                                   "or a built-in set: 'code-edit', 'open-ended'")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vllm serve --speculative-config schema, inline JSON or a .json file (default: none)")
    p.add_argument("--max-tokens", type=positive, default=64, help="new tokens per prompt")
    p.add_argument("--temperature", type=finite, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=finite, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None, help="per-request seed for sampling")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--max-num-seqs", type=positive, default=8, help="concurrent requests")
    p.add_argument("--max-model-len", type=positive, default=None, help="context limit (default: prompt + max tokens)")
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / graph capture")
    add_quantization_flag(p)
    p.add_argument("--only-new", action="store_true", help="print only the generated text, not the prompt")
    p.add_argument("--json", default=None, metavar="PATH", help="write texts, token ids and metrics as JSON")


def run(args) -> int:
    from npuspec.cli import generate_run  # heavy: keeps `--help` and flag errors off torch's import
    return generate_run.run(args)
