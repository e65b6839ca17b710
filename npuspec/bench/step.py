"""Time a decode/verify step: eager vs compiled (backend="npuspec"), one process.

What it builds is the step over the model as `load_model` returns it, with plain
`nn.Linear` weights: it compares the npuspec lowering's small-M linear rewrite (`linear_rows`)
with Inductor's extern mm. The engine (`LLM`) packs the weights at load and runs
`npuspec::linear_packed` instead, so these figures are not the engine's step time (its K = 0
step on SmolLM2 fp32 read ~30 ms here against ~17 ms in the engine, 2026-12-06); for that,
see `npuspec bench peers`, `bench dynk` or `python -m npuspec.bench.linear`.

    python -m npuspec.bench.step --model /tmp/smollm2-hf [--ks 0,4] [--threads 2]
        [--context 300] [--max-model-len 512] [--repeats 30] [--no-baseline] [--profile]

Builds the model, the engine's paged KV pool (block 0 scratch, the request's blocks after
it) and a `VerifyStep` over it, writes `--context` tokens into the request's blocks, then
times batch-1 steps of K+1 tokens, interleaved call by call (so machine noise hits every
variant alike), medians of `--repeats`:
- `eager`: `step_module(**inputs)` on the 1 real row, as `LLM(enforce_eager=True)` runs it;
- `eager_2rows`: the same with one padding row (batch 1 as 2 rows, which compiled engines ran
  before the graphs layer served a lone request as one row), i.e. what the compiled variants
  below multiply: they still run 2 rows;
- `compiled`: `torch.compile(fresh_step_fn(step), backend="npuspec")` with the engine's options
  and token-dim marks, Inductor lowering with the small-M linear rewrite
  (npuspec.compilation.lowering);
- `compiled_mm` (unless --no-baseline): the same without the rewrite (Inductor's extern mm).
Beside them: `bound`, the bytes of every weight matrix read once (embedding rows aside) over
the read bandwidth of a `sum` over a 1 GiB buffer. Greedy tokens of every variant must equal
eager's. `--profile` prints the top ops of each variant (torch.profiler).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from npuspec.bench.table import print_table
from npuspec.compilation import lowering
from npuspec.config import SpeculativeConfig
from npuspec.graphs import mark_token_dim
from npuspec.models import load_model
from npuspec.engine.block_manager import seat_blocks
from npuspec.engine.step import VerifyStep, fresh_step_fn
from npuspec.models.decoder import AttnMetadata


def read_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    buf = torch.ones(mib * 1024 * 1024 // 4)
    buf.sum()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        ts.append(time.perf_counter() - t)
    return buf.numel() * 4 / statistics.median(ts)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every 2-D weight other than the embedding table once, plus
    the embedding when it is the (tied) lm_head."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if p.dim() == 2 and not (name.startswith("embed") and not cfg.tie_word_embeddings):
            total += p.numel() * p.element_size()
    return total


BLOCK = 16  # the engine's default block size


def _slots(blocks: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return blocks[pos // BLOCK] * BLOCK + pos % BLOCK


def step_inputs(k: int, rows: int, context: int, blocks: torch.Tensor, vocab: int,
                seed: int) -> dict:
    """Row 0 is the real request (its K+1 tokens after `context`), the rest padding rows as
    the engine makes them: scratch block, length 0, no drafts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, k + 1), generator=g)  # [rows, K+1]
    pos = torch.zeros(rows, k + 1, dtype=torch.long)
    slots = torch.zeros(rows, k + 1, dtype=torch.long)
    draft = torch.full((rows, k), -1, dtype=torch.long)
    table = torch.zeros(rows, len(blocks), dtype=torch.int32)  # [rows, MB]
    lens = torch.zeros(rows, dtype=torch.int32)
    pos[0] = torch.arange(context, context + k + 1)
    slots[0] = _slots(blocks, pos[0])
    draft[0] = ids[0, 1:]
    table[0] = blocks
    lens[0] = context + k + 1
    return {"input_ids": ids, "positions": pos, "slots": slots, "draft_ids": draft,
            "block_table": table, "seq_lens": lens}


@torch.inference_mode()
def write_context(model, cache, blocks: torch.Tensor, ids: torch.Tensor) -> None:
    """The request's first len(ids) tokens' K/V into its blocks (one forward)."""
    pos = torch.arange(len(ids))[None]  # [1, T]
    meta = AttnMetadata(_slots(blocks, pos), blocks[None].to(torch.int32),
                        torch.tensor([len(ids)], dtype=torch.int32))
    model(ids[None], pos, meta, cache)


# the engine's padding values per step input (npuspec/engine: inert rows)
_PAD = {"draft_ids": -1, "top_p": 1.0, "uniforms": 1.0, "exponentials": 1.0}


def compiled_step(step, k: int, max_num_seqs: int, small_m: bool):
    spec = (SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k,
                                         "k_controller": "fixed"})
            if k else None)
    fn = torch.compile(fresh_step_fn(step), backend="npuspec", dynamic=None,
                       options={"speculative_config": spec, "max_num_seqs": max_num_seqs,
                                "capture": True})

    def run(inp):
        for name, t in inp.items():
            mark_token_dim(t, 0, pad=_PAD.get(name, 0))
        old = lowering.SMALL_M_LINEAR
        lowering.SMALL_M_LINEAR = small_m  # read when the (first) call compiles
        try:
            return fn(**inp)
        finally:
            lowering.SMALL_M_LINEAR = old
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--ks", default="0,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ks = [int(k) for k in a.ks.split(",")]
    cfg, model = load_model(a.model, dtype=torch.float32)
    max_num_seqs = 2  # > 1: the engine pads batch 1 to 2 rows, as with the default 256
    nb = seat_blocks(a.max_model_len, max(ks), BLOCK)
    cache = model.allocate_paged_cache(nb + 1, BLOCK)  # block 0: scratch
    blocks = torch.arange(1, nb + 1)  # the request's
    step = VerifyStep(model, cache)
    g = torch.Generator().manual_seed(0)
    write_context(model, cache, blocks, torch.randint(0, cfg.vocab_size, (a.context,),
                                                      generator=g))
    bw = read_bandwidth()
    wbytes = weight_bytes(model)
    bound_ms = wbytes / bw * 1e3
    print(f"model {a.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab "
          f"{cfg.vocab_size}; weights read per step {wbytes / 1e6:.0f} MB; read bandwidth "
          f"{bw / 1e9:.1f} GB/s -> bound {bound_ms:.1f} ms; threads {a.threads}", flush=True)

    variants = {}
    for k in ks:
        one = step_inputs(k, 1, a.context, blocks, cfg.vocab_size, k)
        two = step_inputs(k, 2, a.context, blocks, cfg.vocab_size, k)
        v = {"eager": (lambda s=step: (lambda i: s(**i)))(), "eager_2rows": None}
        v["eager_2rows"] = v["eager"]
        inputs = {"eager": one, "eager_2rows": two, "compiled": two, "compiled_mm": two}
        t0 = time.perf_counter()
        with torch.inference_mode():
            v["compiled"] = compiled_step(step, k, max_num_seqs, True)
            v["compiled"](dict(two))
        print(f"K={k}: compiled (with linear_rows) in {time.perf_counter() - t0:.0f} s", flush=True)
        if not a.no_baseline:
            t0 = time.perf_counter()
            with torch.inference_mode():
                v["compiled_mm"] = compiled_step(step, k, max_num_seqs, False)
                v["compiled_mm"](dict(two))
            print(f"K={k}: compiled (extern mm) in {time.perf_counter() - t0:.0f} s", flush=True)
        variants[k] = (v, inputs)

    rows, med = [], {}
    for k, (v, inputs) in variants.items():
        ts = {name: [] for name in v}
        with torch.inference_mode():
            ref = v["eager"](dict(inputs["eager"]))
            for name, f in v.items():
                out = f(dict(inputs[name]))
                assert torch.equal(out[:1], ref), f"K={k} {name}: tokens differ from eager"
            for _ in range(a.repeats):
                for name, f in v.items():
                    inp = dict(inputs[name])
                    t = time.perf_counter()
                    f(inp)
                    ts[name].append(time.perf_counter() - t)
        m = {name: statistics.median(x) * 1e3 for name, x in ts.items()}
        med[k] = m
        row = {"K": k, "tokens": k + 1, **{f"{n}_ms": x for n, x in m.items()},
               "compiled/eager": m["compiled"] / m["eager"]}
        if "compiled_mm" in m:
            row["mm/eager"] = m["compiled_mm"] / m["eager"]
        row["bound_ms"] = bound_ms
        row["compiled/bound"] = m["compiled"] / bound_ms
        rows.append(row)
        if a.profile:
            from torch.profiler import profile
            for name, f in v.items():
                with torch.inference_mode(), profile() as p:
                    for _ in range(3):
                        f(dict(inputs[name]))
                print(f"-- K={k} {name} (3 steps)")
                print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    print_table(rows, title=f"batch 1, context {a.context}, fp32, {a.threads} threads, "
                            f"medians of {a.repeats} interleaved calls")
    if len(ks) > 1 and 0 in med:
        for k in ks:
            if k:
                print(f"K={k}/K=0: " + ", ".join(f"{n} {med[k][n] / med[0][n]:.2f}x"
                                                 for n in med[k]))


if __name__ == "__main__":
    main()
