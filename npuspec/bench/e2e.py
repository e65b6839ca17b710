"""`npuspec bench e2e`: npuspec against HF transformers on one checkpoint and one prompt set.

In one process, greedy, on the same token ids (the checkpoint's tokenizer; `--prompts code-edit`:
the built-in code-editing requests in the model's chat template). The model is an HF directory
or a llama.cpp .gguf file (HF loads it with `from_pretrained(dir, gguf_file=name)`):
  HF transformers   generate(do_sample=False)
                    generate(prompt_lookup_num_tokens=K, max_matching_ngram_size=N)
                    generate(do_sample=False) on batches of up to N prompts  (--max-num-seqs N > 1:
                                                    "batched greedy", left-padded, pad = EOS)
                    generate(assistant_model=DRAFT)                 (with --draft-model)
  npuspec           LLM(model) without speculation
                    LLM(model, ngram K, prompt_lookup_min=1, prompt_lookup_max=N)  (HF's rule;
                                                    --speculative-config replaces this config)
                    LLM(model, suffix, num_speculative_tokens=K)   (with --suffix; suffix decoding
                                                    picks each step's draft length, K caps it)
                    LLM(model, draft_model K)                       (with --draft-model)
HF's prompt lookup and assisted generation take one sequence at a time, so every system runs
the prompts one after another (npuspec with max_num_seqs=1) unless --max-num-seqs says
otherwise: with N > 1 npuspec runs up to N requests at once and the HF "batched greedy" row
generates static batches of N (a finished row idles until its batch ends); HF prompt lookup and
assisted stay at one prompt. `--speculative-config` takes inline JSON or a .json file (also the
file `npuspec tune --json` writes); a `num_speculative_tokens_per_batch_size` table picks K by
the number of running requests. Every row is built and warmed up first (load, compilation,
graph capture, one pass: reported as "warm-up s"), then the rows are timed round-robin
--repeats times and each figure is the median wall time for all prompts. Output identity is
checked per prompt, up to and including the first EOS, against HF greedy and against the same
system's greedy row (HF batched greedy against HF greedy: padded batches may change a few fp32
logits, so a mismatch there is reported, not hidden).

`--dtype` (float32, bfloat16, float16; default float32) sets the npuspec rows' dtype; the HF rows
always run float32, so with another dtype "same as HF greedy" compares across dtypes.

Beside tokens/s it prints a weights-read bound: the bytes of the weights a decode step reads
(every matrix and norm as npuspec holds them, in --dtype; the embedding table only when it is
also the tied LM head) divided by the memory read bandwidth that `npuspec bench verify`
measures (median time of a `sum` over a 1 GiB float32 tensor, at the run's thread count). At
batch 1 a step without speculation emits one token per weights read, so that is its ceiling in
tokens/s; speculative and batched rows can pass it (several tokens per read).

    npuspec bench e2e --max-tokens 128 --json e2e.json --plot e2e.png
    npuspec bench e2e --model SmolLM2-135M-Instruct.Q4_1.gguf --prompts code-edit
    npuspec bench e2e --max-num-seqs 4 --suffix --dtype bfloat16 --speculative-config tuned.json
"""
from __future__ import annotations

import argparse
import functools
import json
import platform as _platform
import sys

import torch

from npuspec import __version__
from npuspec.bench import verify
from npuspec.bench.common import Runner, encode, npuspec_runner, run_interleaved, spec_from_flag
from npuspec.bench.hf_runners import (hf_batched_runner, hf_runner, load_hf, require_hf_gguf,
                                      require_transformers)
from npuspec.bench.plots import plot_e2e, require_matplotlib
from npuspec.bench.table import print_table
from npuspec.cli_util import common
from npuspec.cli_util.common import add_threads_flag, positive
from npuspec.cli_util.errors import run_command
from npuspec.cli_util.prompts import BUILTIN_SETS, builtin_prompts, chat_tokenizer, load_prompts
from npuspec.models.loading import read_model_config

SCHEMA = "npuspec.bench.e2e/1"
DTYPES = ("float32", "bfloat16", "float16")  # --dtype: the npuspec rows (HF stays float32)


# ----------------------------------------------------------------------------------------------
# The weights-read bound.

def weight_read_bytes(cfg, dtype_bytes: int = 4) -> int:
    """Bytes of weights one decode step reads: every layer's matrices, biases and norms, the
    final norm and the LM head. The embedding table is read one row per token, so it counts
    only as the tied LM head (tie_word_embeddings), never twice. float32 (npuspec dequantises
    GGUF files and runs float32) unless dtype_bytes says otherwise."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    if cfg.attention_bias:
        per_layer += q + 2 * kv
    if cfg.o_bias:
        per_layer += h
    if cfg.mlp_bias:
        per_layer += 2 * inter + h
    if cfg.qk_norm:
        per_layer += 2 * hd
    n = cfg.num_layers * per_layer + h + cfg.vocab_size * h
    return n * dtype_bytes


def weights_read_bound(weight_bytes: int, bandwidth: float) -> dict:
    """Tokens/s at batch 1 when each token costs one read of the weights at `bandwidth` B/s."""
    if weight_bytes <= 0 or bandwidth <= 0:
        raise ValueError(f"weights_read_bound needs positive bytes and bandwidth, got "
                         f"{weight_bytes} B and {bandwidth} B/s")
    return {"weight_bytes": int(weight_bytes), "bandwidth_bytes_per_s": float(bandwidth),
            "step_s": weight_bytes / bandwidth, "tokens_per_s": bandwidth / weight_bytes}


def measure_bandwidth(repeats: int = 9, mib: int = 1024) -> float:
    """Memory read bandwidth (B/s) on the CPU: `npuspec bench verify`'s 1 GiB float32 sum."""
    return verify.memory_read_bandwidth("cpu", mib, repeats, None)


# ----------------------------------------------------------------------------------------------
# The benchmark.

def _max_model_len(v: str):
    return v if v == "fit" else positive(v)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="npuspec bench e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny",
                   help="target: HF checkpoint directory or .gguf file (default: embedded tiny model)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="draft checkpoint (same vocabulary): adds HF assisted generation and npuspec draft_model")
    p.add_argument("--num-speculative-tokens", "-k", type=positive, default=4, dest="k",
                   help="K: drafts per step for every speculative row (HF prompt_lookup_num_tokens)")
    p.add_argument("--ngram", type=positive, default=3,
                   help="longest n-gram to match (HF max_matching_ngram_size; npuspec prompt_lookup_max)")
    p.add_argument("--speculative-config", default=None, metavar="JSON|PATH",
                   help="override npuspec's ngram row config (vllm serve schema): inline JSON or a "
                        "path to a .json file, either the config itself or what `npuspec tune --json` "
                        "writes (its \"speculative_config\" is used). A num_speculative_tokens_per_"
                        "batch_size table (what tune prints) picks K by the number of running "
                        "requests; the row's K column shows num_speculative_tokens, the largest")
    p.add_argument("--suffix", action="store_true",
                   help="add an npuspec suffix decoding row (num_speculative_tokens = K caps its "
                        "drafts; suffix picks its own length per step up to that)")
    p.add_argument("--max-tokens", type=positive, default=128, help="new tokens per prompt")
    p.add_argument("--prompts", default=None,
                   help="prompt file (.txt/.json/.jsonl), or 'code-edit': 6 built-in code-editing chat "
                        "requests (~240-310 tokens with SmolLM2's template), or 'open-ended': 24 "
                        "chat requests with little to copy; default: the demo prompts")
    p.add_argument("--repeats", type=positive, default=3, help="timed passes per row (median)")
    p.add_argument("--max-model-len", default=None, type=_max_model_len, metavar="N|fit",
                   help="npuspec rows' max_model_len (default: the engine's default, min(2048, the "
                        "model's limit); 'fit': the longest prompt plus --max-tokens)")
    p.add_argument("--max-num-seqs", type=positive, default=1, metavar="N",
                   help="npuspec concurrency; above 1 it also adds an HF 'batched greedy' row "
                        "(generate on left-padded batches of up to N prompts). HF prompt lookup and "
                        "assisted generation always run one prompt at a time")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype of the npuspec rows' weights and activations (default float32); the "
                        "HF rows always run float32. The weights-read bound uses this dtype's bytes")
    p.add_argument("--enforce-eager", action="store_true", help="npuspec without torch.compile")
    p.add_argument("--json", default=None, metavar="PATH", help="write results as JSON")
    add_threads_flag(p)
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="tokens/s per row, acceptance by position, and K and tokens/s over the "
                        "timed pass of each speculative npuspec row (needs matplotlib)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _identical(outs, ref) -> int:
    return sum(a == b for a, b in zip(outs, ref))


def _k_label(cfg) -> str:
    table = cfg.num_speculative_tokens_per_batch_size
    return ", ".join(f"batch {a}{'' if a == b else f'-{b}'}: K={k}" for a, b, k in table) if table else ""


def run(args) -> int:
    transformers = require_transformers()
    if args.plot:
        require_matplotlib("--plot")
    mdir = common.model_dir(args.model)
    if common.is_gguf_model(mdir):
        require_hf_gguf(mdir)
    common.set_threads(args.threads, mdir)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
             "prompt_lookup_max": args.ngram}
    ngram = spec_from_flag(args.speculative_config) or ngram
    ngram_cfg = common.spec_config(ngram)
    suffix_spec = None
    if args.suffix:
        if ngram_cfg.method == "suffix":  # --speculative-config already makes that row suffix
            print("--suffix: the --speculative-config row is already suffix decoding; no second row",
                  file=sys.stderr)
        else:
            suffix_spec = {"method": "suffix", "num_speculative_tokens": args.k}
            common.spec_config(suffix_spec, "--suffix")
    draft_spec = None
    if args.draft_model:
        draft_spec = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k}
        draft_dir = common.check_draft(mdir, common.spec_config(draft_spec, "--draft-model"), "--draft-model")
        if common.is_gguf_model(draft_dir):
            require_hf_gguf(draft_dir, "--draft-model")
    if args.prompts in BUILTIN_SETS:  # chat-templated with transformers' tokenizer if it has one
        chat_tok = chat_tokenizer(mdir)
        prompts = builtin_prompts(args.prompts, mdir, chat_tok)
        ids = encode(mdir, prompts, chat_tok)
        prompt_format = "chat template" if chat_tok is not None else "plain text (no chat template)"
    else:
        prompts = load_prompts(args.prompts)
        ids = encode(mdir, prompts)
        prompt_format = "text"
    cfg = read_model_config(mdir)
    eos = list(cfg.eos_token_ids)
    dtype_bytes = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    bound = weights_read_bound(weight_read_bytes(cfg, dtype_bytes), measure_bandwidth())
    bound["dtype"] = args.dtype

    hf = functools.lru_cache(None)(lambda: load_hf(mdir))
    runners = [Runner("hf", "greedy", 0, hf_runner(hf, ids, args.max_tokens, eos)),
               Runner("hf", "prompt lookup", args.k, hf_runner(
                   hf, ids, args.max_tokens, eos, prompt_lookup_num_tokens=args.k,
                   max_matching_ngram_size=args.ngram))]
    if args.max_num_seqs > 1:
        runners.append(Runner("hf", "batched greedy", 0, hf_batched_runner(
            hf, ids, args.max_tokens, eos, args.max_num_seqs)))
    if args.draft_model:
        def assistant():
            m = load_hf(common.model_dir(args.draft_model, "--draft-model"))
            m.generation_config.num_assistant_tokens = args.k
            m.generation_config.num_assistant_tokens_schedule = "constant"
            return m
        runners.append(Runner("hf", "assisted", args.k, hf_runner(hf, ids, args.max_tokens, eos,
                                                                  assistant_model=assistant)))
    kw = dict(max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager, eos=eos,
              dtype=args.dtype, max_model_len=args.max_model_len)
    runners.append(Runner("npuspec", "greedy", 0, npuspec_runner(mdir, None, ids, args.max_tokens, **kw)))
    runners.append(Runner("npuspec", ngram["method"], ngram_cfg.num_speculative_tokens,
                          npuspec_runner(mdir, ngram, ids, args.max_tokens, **kw)))
    if suffix_spec:
        runners.append(Runner("npuspec", "suffix", args.k,
                              npuspec_runner(mdir, suffix_spec, ids, args.max_tokens, **kw)))
    if draft_spec:
        runners.append(Runner("npuspec", "draft_model", args.k,
                              npuspec_runner(mdir, draft_spec, ids, args.max_tokens, **kw)))
    with common.Progress("bench e2e", len(runners) * (1 + args.repeats)) as bar:
        run_interleaved(runners, args.repeats, bar)

    ref = runners[0].result["token_ids"]
    ref_tps = runners[0].result["tokens"] / runners[0].seconds
    own_greedy = {r.system: r.result["token_ids"] for r in runners if r.method == "greedy"}
    base_tps = {}
    rows = []
    for r in runners:
        res = r.result
        tps = res["tokens"] / r.seconds
        base_tps.setdefault((r.system, r.method), tps)
        m = res.get("metrics") or {}
        rows.append({"system": r.system, "method": r.method, "K": r.k, "tokens": res["tokens"],
                     "seconds": r.seconds, "warmup_seconds": r.warmup_seconds, "tokens_per_s": tps,
                     "vs_hf_greedy": tps / ref_tps,
                     "identical_prompts": _identical(res["token_ids"], ref),
                     "identical": _identical(res["token_ids"], ref) == len(ref),
                     "identical_to_own_greedy": _identical(res["token_ids"], own_greedy[r.system]) == len(ref),
                     "mean_acceptance_length": m.get("mean_acceptance_length"),
                     "acceptance_by_position": m.get("acceptance_by_position"),
                     "k_over_time": m.get("k_over_time") or []})
    for row in rows:
        row["vs_bound"] = row["tokens_per_s"] / bound["tokens_per_s"]
    ratios = _ratios(base_tps, ngram["method"])
    if ("npuspec", "greedy") in base_tps:
        bound["npuspec_greedy_vs_bound"] = base_tps[("npuspec", "greedy")] / bound["tokens_per_s"]
    lengths = [len(x) for x in ids]
    print_table([{"system": r["system"], "method": r["method"], "K": r["K"], "tokens": r["tokens"],
                  "median s": r["seconds"], "warm-up s": r["warmup_seconds"], "tok/s": r["tokens_per_s"],
                  "x bound": r["vs_bound"],
                  "x HF greedy": r["vs_hf_greedy"], "same as HF greedy": f"{r['identical_prompts']}/{len(ref)}",
                  "same as own greedy": "yes" if r["identical_to_own_greedy"] else "NO",
                  "mean acc len": "-" if r["mean_acceptance_length"] is None else r["mean_acceptance_length"]}
                 for r in rows],
                title=f"bench e2e: {len(prompts)} prompts x {args.max_tokens} tokens, greedy, "
                      f"npuspec {args.dtype} (HF float32), max_num_seqs {args.max_num_seqs}, "
                      f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"prompts: {len(ids)} ({prompt_format}), {min(lengths)}-{max(lengths)} tokens "
          f"(mean {sum(lengths) / len(lengths):.0f})")
    mml = args.max_model_len
    print("npuspec max_model_len: " + ("the engine's default" if mml is None else
                                       "fitted to the prompts" if mml == "fit" else str(mml)))
    print(f"dtype: npuspec rows {args.dtype}, HF rows float32"
          + ("" if args.dtype == "float32" else " (so 'same as HF greedy' compares across dtypes)"))
    if args.max_num_seqs > 1:
        print(f"HF batched greedy: generate() on left-padded batches of up to {args.max_num_seqs} "
              f"prompts; HF prompt lookup{' and assisted' if args.draft_model else ''} one prompt "
              f"at a time")
    if _k_label(ngram_cfg):
        print(f"npuspec {ngram_cfg.method} K per batch size: {_k_label(ngram_cfg)} "
              f"(max_num_seqs {args.max_num_seqs})")
    if ngram_cfg.online_k:
        print(f"npuspec {ngram_cfg.method}: K column = the largest K; the online K controller "
              f"(the default) picks each step's K, 0 included (\"k_controller\": \"fixed\" in "
              f"--speculative-config pins it)")
    if suffix_spec:
        print(f"npuspec suffix: up to K={args.k} drafts per step (suffix picks the length), "
              f"max tree depth {common.spec_config(suffix_spec).suffix_decoding_max_tree_depth}")
    print(f"weights-read bound (batch 1, 1 token per read of the weights): "
          f"{bound['weight_bytes'] / 1e6:.1f} MB of {args.dtype} weights / "
          f"{bound['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s (1 GiB sum) = {bound['tokens_per_s']:.1f} tok/s"
          + (f"; npuspec greedy reaches {bound['npuspec_greedy_vs_bound']:.2f}x of it"
             if "npuspec_greedy_vs_bound" in bound else ""))
    for name, v in ratios.items():
        print(f"{name}: {v:.2f}x")
    if args.json:
        doc = {"schema": SCHEMA, "command": args.command_line,
               "model": mdir, "draft_model": args.draft_model, "num_speculative_tokens": args.k,
               "ngram": args.ngram, "max_tokens": args.max_tokens, "num_prompts": len(prompts),
               "repeats": args.repeats, "max_num_seqs": args.max_num_seqs,
               "dtype": args.dtype, "hf_dtype": "float32",
               "hf_batch_size": args.max_num_seqs if args.max_num_seqs > 1 else None,
               "max_model_len": args.max_model_len,
               "npuspec_speculative_config": ngram, "npuspec_suffix_config": suffix_spec,
               "prompts": args.prompts or "demo",
               "prompt_format": prompt_format, "prompt_tokens": lengths, "weights_read_bound": bound,
               "environment": {"npuspec": __version__, "torch": torch.__version__,
                               "transformers": transformers.__version__, "python": _platform.python_version(),
                               "threads": torch.get_num_threads(), "machine": _platform.machine()},
               "rows": rows, "ratios": ratios}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot_e2e(args.plot, rows, {f"{r['system']} {r['method']}": r["acceptance_by_position"]
                                   for r in rows if r["acceptance_by_position"]})
        print(f"wrote {args.plot}")
    return 0


def _ratios(tps: dict, spec_method: str) -> dict[str, float]:
    out = {}
    pairs = [(("npuspec", spec_method), ("hf", "prompt lookup"), f"npuspec {spec_method} / HF prompt lookup"),
             (("npuspec", spec_method), ("npuspec", "greedy"), f"npuspec {spec_method} / npuspec greedy"),
             (("npuspec", "greedy"), ("hf", "greedy"), "npuspec greedy / HF greedy"),
             (("npuspec", "draft_model"), ("hf", "assisted"), "npuspec draft_model / HF assisted"),
             (("npuspec", spec_method), ("hf", "batched greedy"), f"npuspec {spec_method} / HF batched greedy"),
             (("npuspec", "greedy"), ("hf", "batched greedy"), "npuspec greedy / HF batched greedy")]
    if spec_method != "suffix":
        pairs += [(("npuspec", "suffix"), ("hf", "prompt lookup"), "npuspec suffix / HF prompt lookup"),
                  (("npuspec", "suffix"), ("npuspec", "greedy"), "npuspec suffix / npuspec greedy"),
                  (("npuspec", "suffix"), ("hf", "batched greedy"), "npuspec suffix / HF batched greedy")]
    for a, b, name in pairs:
        if a in tps and b in tps:
            out[name] = tps[a] / tps[b]
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.command_line = "npuspec bench e2e " + " ".join(argv)
    return run_command(lambda: run(args), "npuspec bench e2e", args.debug)


if __name__ == "__main__":
    sys.exit(main())
