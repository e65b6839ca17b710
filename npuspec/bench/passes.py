"""Verify-step pass benchmark: backend="npuspec" vs backend="inductor" vs eager, in one run.

    python -m npuspec.bench.passes [--batch 8 64] [--k 4] [--vocab 32000] [--repeats 20]
                                   [--steps ours vllm_v1 vllm_ascend]

The step function is plain PyTorch the way users write it: a greedy verify (argmax, cumprod
accept length, emitted tokens with -1 padding) and a whole standard sampling verify (softmax,
gather, p/q >= u with the user's uniforms, accept length, exponential-race residual and bonus
token with the user's Exp(1) draws, the token at the first rejection). The npuspec backend
rewrites each into one npuspec::rejection_sample call (greedy, and target_is_probs=True). The table
shows the median step time of each, the ratios against eager and Inductor, whether the tokens
equal eager's from the same RNG state, and how many verify patterns the npuspec compile matched.

Compile time: `compile_s` is each backend's first call less its median call (Dynamo, AOT and
the lowering), `passes_s` the time the npuspec pass manager took on that graph
(`passes.manager.TOTALS`: the copy it rewrites, the exact rewrites, the replacements and the
copy back), and `passes_share` that time over the like-for-like Inductor's `compile_s` for the same function.
`search_traced/reused`: the pattern matcher's re-traces of a matched spelling at the graph's
shapes, made or reused (passes/search_memo.py: the first match of a spelling in a process
traces; a later graph whose shapes cannot change the spelling's graph reuses it).
The patterns' one-off registration (tracing every spelling, once per process and flavour) is
paid before the timed compiles and printed on its own.

Baselines: "inductor" is stock backend="inductor", whose RNG (fallback_random=False) draws
different numbers than eager, so its sampled tokens differ; "inductor(fallback_random)" is
Inductor with eager RNG ops, the same RNG contract npuspec keeps, i.e. the like-for-like baseline.
"""
from __future__ import annotations

import argparse
import functools
import time

import torch

from npuspec import counters
from npuspec.bench.table import median_time, print_table
from npuspec.passes import manager, search_memo


def _greedy(logits, drafts):
    # greedy requests: accept drafts while they equal the target argmax
    target = logits.argmax(dim=-1)                                       # [B, K+1]
    n_greedy = (drafts == target[:, :-1]).cumprod(dim=-1).sum(dim=-1)    # [B]
    pos = torch.arange(target.shape[1], device=logits.device)
    return torch.where(pos[None, :] <= n_greedy[:, None], target, -1), n_greedy


def _sampled(p, drafts, draft_probs, u, e):
    # sampling requests: Leviathan et al. on the user's p [B, K+1, V] with the user's draws
    # u [B, K] and e [B, V] (one Exp(1) vector per request), recovered or bonus token
    k = drafts.shape[1]
    px = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    qx = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    n_sample = (px / qx >= u).cumprod(dim=-1).sum(dim=-1)                # [B]
    recovered = (torch.clamp(p[:, :k] - draft_probs, min=0) / e[:, None, :]).argmax(dim=-1)
    bonus = (p[:, k] / e).argmax(dim=-1)                                 # [B]
    token = torch.cat([recovered, bonus[:, None]], 1).gather(1, n_sample[:, None]).squeeze(1)
    return token, n_sample


def verify_step_draws(logits, drafts, draft_probs, u, e):
    """The same step with the draws made by the caller (u [B, K], e [B, V])."""
    greedy_out, n_greedy = _greedy(logits, drafts)
    p = torch.softmax(logits, dim=-1)                                    # [B, K+1, V]
    return (greedy_out, n_greedy) + _sampled(p, drafts, draft_probs, u, e)


def verify_step(logits, drafts, draft_probs):
    greedy_out, n_greedy = _greedy(logits, drafts)
    p = torch.softmax(logits, dim=-1)                                    # [B, K+1, V]
    u = torch.rand(drafts.shape, device=logits.device)                   # [B, K]
    e = torch.empty(p.shape[0], p.shape[2], device=logits.device).exponential_()  # [B, V]
    return (greedy_out, n_greedy) + _sampled(p, drafts, draft_probs, u, e)


def vllm_v1_step_draws(probs, drafts, draft_probs, bonus, u, e):
    """vLLM v1's `forward_native` random path as its authors lay it out (padded drafts, -1 for
    none; the bonus tokens sampled elsewhere; a residual floored at 1e-5 and normalised per
    row; one Exp(1) vector per draft position), written here in our words. The backend makes
    it one `rejection_sample` in composed mode (passes/composed.py)."""
    B, K = drafts.shape
    none = drafts == -1
    x = drafts.masked_fill(none, 0)
    px = probs[:, :K].gather(2, x[..., None])[..., 0]                    # [B, K]
    qx = draft_probs.gather(2, x[..., None])[..., 0].masked_fill(none, float("inf"))
    kept = (u <= px / qx).long().cumprod(dim=1)                          # [B, K] 1 while accepted
    r = torch.clamp(probs[:, :K] - draft_probs, min=1e-5)                # [B, K, V]
    rec = (r / r.sum(-1, keepdim=True) / e).argmax(-1)                   # [B, K]
    n = kept.sum(1)                                                      # [B]
    out = torch.cat([x * kept - (1 - kept), torch.full_like(x[:, :1], -1)], 1)  # [B, K+1]
    rows = torch.arange(B, device=probs.device)
    out[rows, n] = torch.cat([rec, bonus[:, None]], 1)[rows, n]
    return out


def vllm_v1_step(probs, drafts, draft_probs, bonus):
    B, K = drafts.shape
    u = torch.rand(B, K, device=probs.device)
    e = torch.empty(B, K, probs.shape[-1], device=probs.device).exponential_()
    return vllm_v1_step_draws(probs, drafts, draft_probs, bonus, u, e)


def vllm_ascend_step_draws(logits, cu, ids, draft_probs, bonus, u, e, max_spec_len: int):
    """vllm-ascend's PyTorch rejection sampler, random path, laid out as it lays the work out:
    vLLM's ragged layout (flat drafts [N], flat rows [N, V], cu_num_draft_tokens [B]), float64
    uniforms per flat token, one Exp(1) vector per request, every flat row's recovered token
    raced against a guard for zero and infinite draws, then the test and the emission on a
    [B, max_spec_len] grid into a -1 filled buffer. In our words; the backend makes it one
    `rejection_sample` in ragged mode (passes/composed_ragged.py)."""
    N, V = logits.shape
    B, M = cu.shape[0], max_spec_len
    p = logits.softmax(dim=-1)                                           # [N, V]
    start = torch.cat([cu.new_zeros(1), cu[:-1]])                        # [B]
    owner = (torch.arange(N, device=p.device)[:, None] >= cu[None, :]).sum(1)   # [N]
    g = e[owner]                                                         # [N, V]
    off = (g == 0) | torch.isinf(g)
    score = torch.clamp(p - draft_probs, min=0) / torch.where(off, 1e-10, g)
    rec = torch.where(off, -1e10, score).argmax(dim=1)                   # [N]
    slot = torch.arange(M, device=p.device)[None, :]                     # [1, M]
    lens = cu - start
    live = slot < lens[:, None]                                          # [B, M]
    rows = torch.clamp(start[:, None] + slot, 0, N - 1)
    x = ids[rows]                                                        # [B, M]
    xs = torch.where(x == -1, 0, x)
    ok = (draft_probs[rows, xs] > 0) & (p[rows, xs] / draft_probs[rows, xs] >= u[rows])
    ok = ok & (x != -1)
    n = ((ok | ~live).long().cumprod(dim=1) * live).sum(dim=1)           # [B] accepted
    out = torch.full((B, M + 1), -1, dtype=torch.int32, device=p.device)
    out[:, :M] = torch.where(slot < n[:, None], x, -1).int()
    tok = torch.where(n < lens, rec[torch.clamp(start + n, max=N - 1)], bonus.long())
    out[torch.arange(B, device=p.device), n] = tok.int()
    return out


def vllm_ascend_step(logits, cu, ids, draft_probs, bonus, max_spec_len: int):
    u = torch.rand(ids.shape[0], dtype=torch.float64, device=logits.device)
    e = torch.empty(cu.shape[0], logits.shape[-1], device=logits.device).exponential_()
    return vllm_ascend_step_draws(logits, cu, ids, draft_probs, bonus, u, e, max_spec_len)


def _ragged_inputs(args, g, device):
    """The padded inputs flattened as vLLM lays drafts out: request b keeps K - (b % 2) of
    its K drafts. -> (flat logits [N, V], cu [B], flat ids [N], flat q [N, V], bonus [B])."""
    logits, drafts, draft_probs = args
    B, K = drafts.shape
    keep = torch.arange(K)[None, :] < (K - torch.arange(B) % 2)[:, None]   # [B, K]
    cu = keep.sum(1).cumsum(0)
    bonus = torch.randint(0, logits.shape[-1], (B,), generator=g)
    return (logits[:, :K][keep].contiguous(), cu.to(device), drafts[keep].contiguous(),
            draft_probs[keep].contiguous(), bonus.to(device))


def make_inputs(B: int, K: int, V: int, device: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    draft_probs = torch.softmax(torch.randn(B, K, V, generator=g) + logits[:, :-1], -1)
    drafts = torch.multinomial(draft_probs.view(-1, V), 1, generator=g).view(B, K)
    return logits.to(device), drafts.to(device), draft_probs.to(device)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


VARIANTS = ("eager", "inductor", "inductor(fallback_random)", "npuspec", "npuspec(eager lowering)")


def run_case(B: int, K: int, V: int, repeats: int, device: str, draws: str,
             variants=VARIANTS, step_name: str = "ours") -> list[dict]:
    args = make_inputs(B, K, V, device)
    step = verify_step
    g = torch.Generator().manual_seed(1)
    e_shape = (B, V)
    if step_name == "vllm_v1":  # probabilities in, a bonus token per request, E per position
        step, e_shape = vllm_v1_step, (B, K, V)
        logits, drafts, draft_probs = args
        drafts = drafts.clone()
        drafts[0, K // 2:] = -1                     # a request with fewer drafts than K
        args = (torch.softmax(logits, -1), drafts, draft_probs,
                torch.randint(0, V, (B,), generator=g).to(device))
    if step_name == "vllm_ascend":  # vLLM's ragged layout, max_spec_len = K
        args = _ragged_inputs(args, g, device)
        step = functools.partial(vllm_ascend_step, max_spec_len=K)
        if draws == "outside":
            N = args[2].shape[0]
            draws_ = (torch.rand(N, generator=g, dtype=torch.float64).to(device),
                      torch.empty(B, V).exponential_(generator=g).to(device))
            step = functools.partial(vllm_ascend_step_draws, max_spec_len=K)
            args = args + draws_
    elif draws == "outside":
        step = verify_step_draws if step_name == "ours" else vllm_v1_step_draws
        args = args + (torch.rand(B, K, generator=g).to(device),
                       torch.empty(e_shape).exponential_(generator=g).to(device))
    sync = torch.cuda.synchronize if device == "cuda" else None
    torch.manual_seed(0)
    ref = step(*args)
    rows = []
    times, compile_s = {}, {}
    for name in variants:
        torch._dynamo.reset()
        before = counters.snapshot()
        fn = step
        if name == "inductor":
            fn = torch.compile(step, backend="inductor")
        elif name == "inductor(fallback_random)":
            from torch._inductor.compile_fx import compile_fx

            def inductor_eager_rng(gm, ex):
                return compile_fx(gm, ex, config_patches={"fallback_random": True})

            fn = torch.compile(step, backend=inductor_eager_rng)
        elif name == "npuspec":
            fn = torch.compile(step, backend="npuspec",
                               options={"lowering": "inductor", "capture": False})
        elif name.startswith("npuspec("):
            fn = torch.compile(step, backend="npuspec",
                               options={"lowering": "eager", "capture": False})
        torch.manual_seed(0)
        spent, traced = manager.TOTALS["seconds"], dict(search_memo.STATS)
        t0 = time.perf_counter()
        out = fn(*args)                                  # compiles
        first = time.perf_counter() - t0
        passes_s = manager.TOTALS["seconds"] - spent
        reused = search_memo.STATS["reused"] - traced["reused"]
        retraced = search_memo.STATS["traced"] - traced["traced"]
        matched = counters.delta(before).get("verify_patterns_matched", 0)
        times[name] = median_time(lambda: fn(*args), repeats=repeats, warmup=2, sync=sync)
        compile_s[name] = max(first - times[name], 0.0) if name != "eager" else 0.0
        fr = "inductor(fallback_random)"
        rows.append({"step": step_name, "draws": draws, "B": B, "V": V, "backend": name,
                     "median_ms": times[name] * 1e3,
                     "vs_eager": times["eager"] / times[name],
                     "vs_inductor": times["inductor"] / times[name] if "inductor" in times else float("nan"),
                     "vs_inductor_eager_rng": times[fr] / times[name] if fr in times else float("nan"),
                     "tokens==eager": "yes" if _same(out, ref) else "no",
                     "patterns_matched": matched, "compile_s": compile_s[name],
                     "passes_s": passes_s,
                     "search_traced/reused": (f"{retraced}/{reused}" if name.startswith("npuspec")
                                              else "-"),
                     "passes_share": (passes_s / compile_s[fr] if name.startswith("npuspec")
                                      and compile_s.get(fr) else float("nan"))})
    return rows


def register_patterns() -> float:
    """Trace every family's spellings for both flavours (once per process). -> seconds."""
    t0 = time.perf_counter()
    pm = manager.PassManager()
    for flavor in manager.FLAVORS:
        for p in pm.patterns:
            manager.compiled(p, flavor)
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--draws", nargs="+", choices=("outside", "inside"), default=["outside", "inside"],
                    help="outside: u and E are step inputs; inside: the step draws them "
                         "(torch.rand, exponential_), which dominates CPU time")
    ap.add_argument("--steps", nargs="+", choices=("ours", "vllm_v1", "vllm_ascend"),
                    default=["ours"],
                    help="ours: a greedy and a standard sampling verify; vllm_v1: vLLM v1's "
                         "forward_native random path (one rejection_sample in composed mode); "
                         "vllm_ascend: vllm-ascend's PyTorch sampler on vLLM's ragged layout "
                         "(one rejection_sample in ragged mode)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shared-inductor-cache", action="store_true",
                    help="use the user's Inductor cache instead of a fresh temporary one")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: OpenMP spinning on a shared machine "
                         "swamps the comparison)")
    a = ap.parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    if not a.shared_inductor_cache:
        # a warm FX graph cache skips the passes (the cached graph already holds the npuspec
        # ops), which would zero the match counts and hide compile work; start from empty
        import os
        import tempfile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="npuspec-bench-")
    print(f"pattern registration (once per process, both flavours): {register_patterns():.2f} s")
    rows = []
    for step_name in a.steps:
        for draws in a.draws:
            for B in a.batch:
                rows += run_case(B, a.k, a.vocab, a.repeats, a.device, draws,
                                 step_name=step_name)
    cols = ["step", "draws", "B", "V", "backend", "median_ms", "vs_eager", "vs_inductor",
            "vs_inductor_eager_rng", "tokens==eager", "patterns_matched", "compile_s",
            "passes_s", "search_traced/reused", "passes_share"]
    print_table(rows, cols, title=f"verify step, K={a.k}, {a.device}, {torch.get_num_threads()} "
                                  f"thread(s): npuspec vs inductor vs eager (ratio > 1: faster "
                                  f"than that baseline)")
    return rows


if __name__ == "__main__":
    main()
