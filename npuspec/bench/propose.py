"""Replay token traces through the drafters as oracle-verified greedy decoding.

    python -m npuspec.bench.propose [TRACES.jsonl ...] [-k 8] [--limit N]

Each trace is {"prompt": [ids], "response": [ids]} (see npuspec/bench/make_traces.py; default:
the shipped edit / extract / multisample traces). The response plays the target model's greedy
output: each step a proposer drafts up to K tokens from the context (prompt + response so far),
the longest prefix equal to the true continuation is accepted, and one target token follows, so
a step emits accepted + 1 tokens (clipped at the end of the response). Each proposer replays the
traces of one file in order with one instance, so the global suffix tree sees earlier responses.

Printed per file and proposer: tokens/step (= mean acceptance length), accepted/step, steps,
median us per propose call and per extended token (for ours: the proposer API calls; for the
peers: the library call a serving engine makes, with inputs already in the library's format).
Drafters: "ngram", "suffix" (the public SuffixProposer: the compiled port, or the Python
reference if it could not be built, as its row then says), "suffix-ref" (the Python
SuffixProposerReference), and the peers when installed: Arctic Inference's
SuffixDecodingCache ("arctic-suffix", same parameters) and HF transformers'
PromptLookupCandidateGenerator ("hf-lookup", max n = prompt_lookup_max).

A second table ("targets") times the issue's speed targets on 4096-token contexts, including
the host time of one propose step for a batch of --batch requests (ours: one `propose` call;
Arctic, which has no batch API: one `speculate` call per request, as vLLM makes them). A third
puts the suffix drafters side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from npuspec.bench.make_traces import TRACE_FILES, TRACES_DIR
from npuspec.bench.table import print_table
from npuspec.spec_decode.ngram import NgramProposer
from npuspec.spec_decode.suffix import SuffixProposer
from npuspec.spec_decode.suffix_reference import SuffixProposerReference


def load_traces(path: str, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            if not isinstance(r, dict) or "prompt" not in r or "response" not in r:
                raise ValueError(f"{path}:{ln}: a trace line must be a JSON object with 'prompt' "
                                 "and 'response' token-id lists (see npuspec/bench/make_traces.py)")
            rows.append(r)
            if limit and len(rows) == limit:
                break
    return rows


# -- adapters: one small object per drafter, all with the same four calls ---------------------
class Ours:
    def __init__(self, proposer):
        self.p = proposer

    def start(self, rid, prompt):
        self.p.start_request(rid, prompt)

    def extend(self, rid, toks):
        self.p.extend(rid, toks)

    def propose(self, rid, k):
        return self.p.propose([rid], k)[0]

    def stop(self, rid):
        self.p.stop_request(rid)


class ArcticSuffix:
    """Arctic's cache driven the way vLLM's SuffixDecodingProposer drives it (numpy int32
    views, zero-copy; context = the last max_tree_depth tokens)."""

    def __init__(self, a):
        import numpy as np
        from arctic_inference.suffix_decoding import SuffixDecodingCache
        self.np = np
        self.a = a
        self.c = SuffixDecodingCache(max_tree_depth=a.max_tree_depth,
                                     max_cached_requests=a.max_cached_requests)
        self.offset = getattr(a, "max_spec_offset", 0.0)
        self.buf, self.n = {}, {}

    def start(self, rid, prompt):
        np = self.np
        buf = np.zeros(2 * len(prompt) + 2, dtype=np.int32)
        buf[:len(prompt)] = prompt
        self.buf[rid], self.n[rid] = buf, len(prompt)
        self.c.start_request(rid, buf[:len(prompt)])

    def extend(self, rid, toks):
        np = self.np
        buf, n = self.buf[rid], self.n[rid]
        if n + len(toks) > len(buf):
            buf = self.buf[rid] = np.concatenate([buf, np.zeros_like(buf)])
        buf[n:n + len(toks)] = toks
        self.n[rid] = n + len(toks)
        self.c.add_active_response(rid, buf[n:n + len(toks)])

    def propose(self, rid, k):
        n = self.n[rid]
        ctx = self.buf[rid][max(0, n - self.a.max_tree_depth):n]
        return self.c.speculate(rid, ctx, max_spec_tokens=k, max_spec_factor=self.a.max_spec_factor,
                                max_spec_offset=self.offset,
                                min_token_prob=self.a.min_token_prob).token_ids

    def stop(self, rid):
        self.c.stop_request(rid)
        del self.buf[rid], self.n[rid]


class HFLookup:
    """transformers' prompt lookup; the context is kept in a torch buffer and passed as a view."""

    def __init__(self, a, k_max):
        import torch
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
        self.torch = torch
        self.gens = {k: PromptLookupCandidateGenerator(
            num_output_tokens=k, max_matching_ngram_size=a.prompt_lookup_max,
            max_length=1 << 30) for k in range(1, k_max + 1)}
        self.buf, self.n = {}, {}

    def start(self, rid, prompt):
        buf = self.torch.zeros(1, 2 * len(prompt) + 2, dtype=self.torch.long)
        buf[0, :len(prompt)] = self.torch.tensor(prompt)
        self.buf[rid], self.n[rid] = buf, len(prompt)

    def extend(self, rid, toks):
        buf, n = self.buf[rid], self.n[rid]
        if n + len(toks) > buf.shape[1]:
            buf = self.buf[rid] = self.torch.cat([buf, self.torch.zeros_like(buf)], dim=1)
        buf[0, n:n + len(toks)] = self.torch.tensor(toks)
        self.n[rid] = n + len(toks)

    def propose(self, rid, k):
        if k == 0:
            return []
        n = self.n[rid]
        out, _ = self.gens[k].get_candidates(self.buf[rid][:, :n])
        return out[0, n:].tolist()

    def stop(self, rid):
        del self.buf[rid], self.n[rid]


def suffix_args(a) -> tuple:
    return (a.max_tree_depth, a.max_cached_requests, a.max_spec_factor, a.min_token_prob,
            getattr(a, "max_spec_offset", 0.0))


SUFFIX_DRAFTERS = ("suffix", "suffix-ref", "arctic-suffix")


def drafters(a, k_max: int, only=()) -> dict:
    """name -> factory of a fresh adapter; peers only when importable (and wanted)."""
    out = {
        "ngram": lambda: Ours(NgramProposer(a.prompt_lookup_min, a.prompt_lookup_max)),
        "suffix": lambda: Ours(SuffixProposer(*suffix_args(a))),
        "suffix-ref": lambda: Ours(SuffixProposerReference(*suffix_args(a))),
    }
    try:
        if not only or "arctic-suffix" in only:
            import arctic_inference.suffix_decoding  # noqa: F401
            out["arctic-suffix"] = lambda: ArcticSuffix(a)
    except ImportError:
        pass
    try:
        if not only or "hf-lookup" in only:
            import transformers.generation.candidate_generator  # noqa: F401
            out["hf-lookup"] = lambda: HFLookup(a, k_max)
    except ImportError:
        pass
    return out


# -- replay -------------------------------------------------------------------------------
def replay(adapter, traces: list[dict], k: int) -> dict:
    steps = accepted = emitted = 0
    t_prop: list[float] = []
    t_ext: list[float] = []
    clock = time.perf_counter_ns
    for i, tr in enumerate(traces):
        rid = f"r{i}"
        prompt, resp = list(tr["prompt"]), list(tr["response"])
        adapter.start(rid, prompt)
        pos, R = 0, len(resp)
        while pos < R:
            t0 = clock()
            draft = adapter.propose(rid, k)
            t_prop.append(clock() - t0)
            a = 0
            for d in draft[:k]:
                if pos + a < R and d == resp[pos + a]:
                    a += 1
                else:
                    break
            n = min(a + 1, R - pos)
            new = resp[pos:pos + n]
            t0 = clock()
            adapter.extend(rid, new)
            t_ext.append((clock() - t0) / n)
            pos += n
            steps += 1
            accepted += min(a, n)
            emitted += n
        adapter.stop(rid)
    return {"tokens/step": emitted / max(steps, 1), "accepted/step": accepted / max(steps, 1),
            "steps": steps, "us/propose": statistics.median(t_prop) / 1e3 if t_prop else 0.0,
            "us/extend-token": statistics.median(t_ext) / 1e3 if t_ext else 0.0,
            "_t_prop": t_prop, "_t_ext": t_ext}


# -- speed targets ------------------------------------------------------------------------
def calibrate() -> float:
    """ns per iteration of an empty Python loop: how fast this interpreter runs right now (the
    timings below scale with it; a contended CPU inflates all of them alike)."""
    ts = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(200_000):
            pass
        ts.append((time.perf_counter_ns() - t0) / 200_000)
    return statistics.median(ts)


def targets(a, k: int, corpus: list[int], names: dict, n_req: int = 256) -> list[dict]:
    """The issue's speed targets on 4096-token contexts cut from `corpus` (median us):
    propose for one request, propose for a batch of n_req (ours only: the peers have no batch
    API), and the per-token cost of extend (3 tokens a step) and of start_request."""
    ctx_len = 4096
    step = max(1, (len(corpus) - ctx_len - 200) // n_req)
    ctxs = [corpus[i * step:i * step + ctx_len + 200] for i in range(n_req)]
    ctxs = [c for c in ctxs if len(c) == ctx_len + 200]
    rows = [{"what": "calibration: empty Python loop iteration", "us": calibrate() / 1e3}]
    wall, cpu = time.perf_counter_ns, time.thread_time_ns

    def timed(fn, per=1):
        """(wall ns, this thread's CPU ns) of fn() / per; CPU time leaves out the time other
        processes hold the core (a shared machine), and costs ~0.5 us of clock overhead."""
        c0, w0 = cpu(), wall()
        fn()
        w1, c1 = wall(), cpu()
        return (w1 - w0) / per, (c1 - c0) / per

    def row(what, samples):
        return {"what": what, "us": statistics.median(s[0] for s in samples) / 1e3,
                "cpu us": statistics.median(s[1] for s in samples) / 1e3}

    def per_request(ad, label, n=32):
        prop, ext, start = [], [], []
        for i, c in enumerate(ctxs[:n]):
            rid = f"t{i}"
            start.append(timed(lambda: ad.start(rid, c[:ctx_len]), ctx_len))
            for j in range(ctx_len, ctx_len + 60, 3):  # 20 steps of 3 emitted tokens
                prop.append(timed(lambda: ad.propose(rid, k)))
                ext.append(timed(lambda: ad.extend(rid, c[j:j + 3]), 3))
            ad.stop(rid)
        return [row(f"{label}: propose, 1 request, ctx 4096", prop),
                row(f"{label}: extend, per token", ext),
                row(f"{label}: start_request, per prompt token", start)]

    for name in ("ngram", "hf-lookup", "suffix", "suffix-ref", "arctic-suffix"):
        if name in names:
            rows += per_request(names[name](), name)
    for name in ("ngram", "suffix", "suffix-ref", "arctic-suffix"):
        if name in names:
            rows.append(batch_step(names[name](), name, k, ctxs, ctx_len, timed, row))
    return rows


def batch_step(ad, name: str, k: int, ctxs: list, ctx_len: int, timed, row) -> dict:
    """Host time of one propose step over len(ctxs) running requests (median of 20)."""
    ids = [f"b{i}" for i in range(len(ctxs))]
    for rid, c in zip(ids, ctxs):
        ad.start(rid, c[:ctx_len])
    if isinstance(ad, Ours):
        p = ad.p
        step, how = (lambda: p.propose(ids, k)), "one call"
    else:
        step, how = (lambda: [ad.propose(rid, k) for rid in ids]), "a call per request"
    step()
    r = row(f"{name}: propose, batch of {len(ids)}, ctx 4096 ({how})",
            [timed(step) for _ in range(20)])
    for rid in ids:
        ad.stop(rid)
    return r


def side_by_side(results: dict, target_rows: list[dict], batch: int) -> list[dict]:
    """One row per suffix drafter: tokens/step over all files, median us per propose call and
    per extended token over all replayed steps, and the batch step in ms (targets table)."""
    out = []
    for name, (emitted, steps, t_prop, t_ext) in results.items():
        r = {"drafter": name, "tokens/step": emitted / max(steps, 1),
             "propose us": statistics.median(t_prop) / 1e3 if t_prop else float("nan"),
             "extend us/token": statistics.median(t_ext) / 1e3 if t_ext else float("nan")}
        for t in target_rows:
            if t["what"].startswith(f"{name}: propose, batch of {batch}"):
                r[f"batch-{batch} step ms"] = t["us"] / 1e3
        out.append(r)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", help="trace files (default: the shipped set)")
    ap.add_argument("-k", default="8", help="max draft tokens per step; comma list (default 8)")
    ap.add_argument("--limit", type=int, default=None, help="at most N traces per file")
    ap.add_argument("--only", default="", help="comma list of drafters to run (default: all)")
    ap.add_argument("--no-targets", action="store_true", help="skip the 4096-context timings")
    ap.add_argument("--batch", type=int, default=256, help="requests in the batch timing")
    ap.add_argument("--prompt-lookup-min", type=int, default=5)
    ap.add_argument("--prompt-lookup-max", type=int, default=5)
    ap.add_argument("--max-tree-depth", type=int, default=24)
    ap.add_argument("--max-cached-requests", type=int, default=10000)
    ap.add_argument("--max-spec-factor", type=float, default=1.0)
    ap.add_argument("--min-token-prob", type=float, default=0.1)
    ap.add_argument("--max-spec-offset", type=float, default=0.0)
    a = ap.parse_args(argv)
    try:
        ks = [int(x) for x in a.k.split(",")]
        assert ks and all(x >= 1 for x in ks)
    except (ValueError, AssertionError):
        ap.error(f"-k {a.k!r}: give one or more ints >= 1, comma separated (e.g. -k 4,8,16)")
    paths = a.traces or [os.path.join(TRACES_DIR, f) for f in TRACE_FILES]
    want = [w for w in a.only.split(",") if w]
    names = drafters(a, max(ks), want)
    if want:
        unknown = [w for w in want if w not in names]
        if unknown:
            ap.error(f"--only {unknown}: known (installed) drafters are {sorted(names)}")
        names = {n: f for n, f in names.items() if n in want}
    if "suffix" in names and not SuffixProposer().native:
        print("note: the compiled suffix proposer could not be built (see the warning above); "
              "'suffix' runs the Python reference")
    data = {p: load_traces(p, a.limit) for p in paths}
    first: dict = {}
    for k in ks:
        tot = replay_table(a, k, data, names)
        first = first or tot
    target_rows = []
    if not a.no_targets:
        corpus = [t for traces in data.values() for tr in traces
                  for t in list(tr["prompt"]) + list(tr["response"])]
        target_rows = targets(a, ks[0], corpus, names, a.batch)
        print_table(target_rows, ["what", "us", "cpu us"],
                    title=f"targets (K={ks[0]}; median wall / thread-CPU us)")
    peers = {n: v for n, v in first.items() if n in SUFFIX_DRAFTERS}
    if peers:
        cols = ["drafter", "tokens/step", "propose us", "extend us/token"]
        cols += [] if a.no_targets else [f"batch-{a.batch} step ms"]
        print_table(side_by_side(peers, target_rows, a.batch), cols,
                    title=f"suffix drafters side by side (K={ks[0]}; all traces; median us "
                          f"per replayed call)")


def replay_table(a, k: int, data: dict, names: dict) -> dict:
    """Replay every file with every drafter at K = k and print the table; returns name ->
    (tokens emitted, steps, propose ns samples, extend ns-per-token samples)."""
    rows = []
    tot: dict[str, list] = {n: [0, 0, [], []] for n in names}
    for path, traces in data.items():
        for name, make in names.items():
            r = replay(make(), traces, k)
            t = tot[name]
            t[0] += r["tokens/step"] * r["steps"]
            t[1] += r["steps"]
            t[2] += r.pop("_t_prop")
            t[3] += r.pop("_t_ext")
            rows.append({"traces": os.path.basename(path), "drafter": name, **r})
    for name in names:
        e, s = tot[name][:2]
        rows.append({"traces": "all", "drafter": name, "tokens/step": e / max(s, 1),
                     "accepted/step": e / max(s, 1) - 1, "steps": int(s)})
    print_table(rows, ["traces", "drafter", "tokens/step", "accepted/step", "steps",
                       "us/propose", "us/extend-token"],
                title=f"oracle greedy replay, K={k} (depth {a.max_tree_depth}, factor "
                      f"{a.max_spec_factor}, offset {a.max_spec_offset}, min prob "
                      f"{a.min_token_prob}, ngram {a.prompt_lookup_min}..{a.prompt_lookup_max})")
    return tot


if __name__ == "__main__":
    main()
