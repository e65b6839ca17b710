"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; Arctic Inference), pure Python.

What it computes (the same quantities as Arctic Inference's suffix trees):
  * two "trees": one per request over its own tokens (prompt + what it emitted so far), and one
    global tree over the responses of previous and running requests, FIFO-evicted once more than
    `max_cached_requests` responses are cached (0 disables the global tree);
  * count(s) = number of occurrences of the token string s (|s| <= max_tree_depth) in a tree;
  * for the last m tokens s of the context (m = 1 .. min(len, depth) - 1): follow the most frequent
    continuation t1, t2, ... where token j has probability count(s t1..tj) / count(s) (the running
    product of the child/parent count ratios), while it stays >= min_token_prob, for at most
    min(K, floor(m * max_spec_factor + max_spec_offset)) tokens and m + j <= max_tree_depth;
  * score = the sum of those probabilities; the best m wins (ties: the longer match), and the
    better tree wins (ties: the request's own tree).

How (why it is not a pointer-based suffix tree): a Python suffix tree with counts must touch up to
`max_tree_depth` nodes per appended token (every suffix ending there), ~20 us per token per tree in
CPython. Instead each tree keeps its token sequences plus three occurrence indexes (the 1-, 3- and
8-gram ending at each position -> where it ends), so `extend` is O(1) per token. `propose` derives
the counts above lazily from the occurrences of the context's tail: the 8-gram index yields every
occurrence of a match of length >= 8 (exact counts), the shorter indexes those of shorter matches.
The search walks m from long to short and stops once min(K, m * factor + offset) cannot beat the
best score so far, so a confident long match never looks at the (large) short-match sets. Counts
for matches shorter than 8 come from at most the `_WINDOW` most recent occurrences (the only
approximation; these drafts are short by construction, <= m * factor tokens).

Most-frequent-child ties go to the token whose occurrence is the most recent.
"""
from __future__ import annotations

from typing import Sequence

from npuspec.runtime.proposer import duplicate_request, per_request_k, unknown_request

_LONG = 8        # occurrences of matches >= _LONG tokens come from this index, all of them
_MID = 3
_WINDOW = 64     # most recent occurrences used for matches shorter than _LONG
_LONG_WINDOW = 4096  # safety bound on the long index's scan (pathological repetition)
_LEVELS = (1, _MID, _LONG)
_TIE_RECENT = True  # most-frequent-child ties: most recent occurrence (False: first to the count)


def _as_list(tokens) -> list[int]:
    if hasattr(tokens, "tolist"):
        return tokens.tolist()
    return list(tokens)


class _Tree:
    """Token sequences plus n-gram -> [(seq_id, end_pos)] indexes, in insertion order."""

    __slots__ = ("seqs", "index", "dead")

    def __init__(self):
        self.seqs: dict[int, list[int]] = {}
        self.index: dict[tuple, list[tuple[int, int]]] = {}
        self.dead = 0  # refs in `index` that point at evicted sequences

    def add_seq(self, sid: int, tokens: list[int]) -> None:
        """Register `tokens` (a list this tree now shares) and index all of it."""
        self.seqs[sid] = tokens
        index = self.index
        T = len(tokens)
        for n in _LEVELS:
            # keys tokens[s:s+n] end at e = s+n-1; zip builds them in C
            for key, e in zip(zip(*[tokens[j:T - n + 1 + j] for j in range(n)]), range(n - 1, T)):
                lst = index.get(key)
                if lst is None:
                    index[key] = [(sid, e)]
                else:
                    lst.append((sid, e))

    def append(self, sid: int, seq: list[int], new: list[int]) -> None:
        index = self.index
        for t in new:
            seq.append(t)
            e = len(seq) - 1
            ref = (sid, e)
            for n in _LEVELS:
                if n > e + 1:
                    break
                key = (t,) if n == 1 else tuple(seq[e - n + 1:])
                lst = index.get(key)
                if lst is None:
                    index[key] = [ref]
                else:
                    lst.append(ref)

    def remove_seq(self, sid: int) -> None:
        seq = self.seqs.pop(sid)
        self.dead += len(seq) * len(_LEVELS)
        live = sum(len(s) for s in self.seqs.values()) * len(_LEVELS)
        if self.dead > max(live, 4096):
            self._compact()

    def _compact(self) -> None:
        seqs = self.seqs
        new = {}
        for key, lst in self.index.items():
            kept = [r for r in lst if r[0] in seqs]
            if kept:
                new[key] = kept
        self.index = new
        self.dead = 0

    def num_tokens(self) -> int:
        return sum(len(s) for s in self.seqs.values())

    def count(self, s: Sequence[int]) -> int:
        """Exact occurrences of the string s (for tests and debugging; scans)."""
        s = list(s)
        n = len(s)
        return sum(1 for seq in self.seqs.values() for i in range(len(seq) - n + 1)
                   if seq[i:i + n] == s)


def _path(refs, seqs, need: int, denom: int, min_prob: float):
    """Greedy most-frequent continuation after the occurrences `refs` (oldest first).

    Returns (tokens, probs); prob_j = (#refs continuing with t1..tj) / denom."""
    toks: list[int] = []
    probs: list[float] = []
    cur = [(seqs[sid], e) for sid, e in refs]
    for j in range(1, need + 1):
        if len(cur) == 1:  # one continuation left: copy it at constant probability
            seq, e = cur[0]
            p = 1.0 / denom
            if p < min_prob:
                break
            tail = seq[e + j:e + need + 1]
            toks += tail
            probs += [p] * len(tail)
            break
        counts: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, (seq, e) in enumerate(cur):
            q = e + j
            if q < len(seq):
                t = seq[q]
                counts[t] = counts.get(t, 0) + 1
                last[t] = i
        if not counts:
            break
        t = max(counts, key=lambda x: (counts[x], last[x]))  # ties: most recent occurrence
        if not _TIE_RECENT and counts[t] == 1:
            t = next(iter(counts))  # Arctic's order for count-1 ties: the oldest
        p = counts[t] / denom
        if p < min_prob:
            break
        toks.append(t)
        probs.append(p)
        cur = [(seq, e) for seq, e in cur if e + j < len(seq) and seq[e + j] == t]
    return toks, probs


class SuffixProposer:
    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_spec_offset: float = 0.0):
        if not isinstance(max_tree_depth, int) or isinstance(max_tree_depth, bool) \
                or max_tree_depth < 1:
            raise ValueError(f"SuffixProposer: max_tree_depth={max_tree_depth!r} must be an "
                             "int >= 1 (default 24)")
        if not isinstance(max_cached_requests, int) or isinstance(max_cached_requests, bool) \
                or max_cached_requests < 0:
            raise ValueError(f"SuffixProposer: max_cached_requests={max_cached_requests!r} must "
                             "be an int >= 0 (0 disables the global tree; default 10000)")
        if not isinstance(max_spec_factor, (int, float)) or not max_spec_factor > 0:
            raise ValueError(f"SuffixProposer: max_spec_factor={max_spec_factor!r} must be a "
                             "number > 0 (default 1.0)")
        if not isinstance(min_token_prob, (int, float)) or not 0 <= min_token_prob <= 1:
            raise ValueError(f"SuffixProposer: min_token_prob={min_token_prob!r} must be in "
                             "[0, 1] (default 0.1)")
        if not isinstance(max_spec_offset, (int, float)) or max_spec_offset != max_spec_offset:
            raise ValueError(f"SuffixProposer: max_spec_offset={max_spec_offset!r} must be a "
                             "number (default 0.0)")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self.max_spec_offset = float(max_spec_offset)
        self._local: dict[str, _Tree] = {}      # req_id -> tree over its prompt + output
        self._global = _Tree()                  # responses, FIFO order = self._cached order
        self._cached: dict[str, int] = {}       # req_id -> seq id in the global tree
        self._next_sid = 0

    # -- request lifecycle -------------------------------------------------------------------
    def start_request(self, req_id: str, prompt: Sequence[int]) -> None:
        if req_id in self._local:
            raise duplicate_request("SuffixProposer.start_request", req_id)
        tree = _Tree()
        tree.add_seq(0, _as_list(prompt))
        self._local[req_id] = tree
        if self.max_cached_requests == 0:
            return
        if req_id in self._cached:  # a reused id replaces its old cached response
            self._global.remove_seq(self._cached.pop(req_id))
        sid = self._next_sid
        self._next_sid += 1
        self._global.add_seq(sid, [])
        self._cached[req_id] = sid
        while len(self._cached) > self.max_cached_requests:  # FIFO; never the new one
            old = next(iter(self._cached))
            self._global.remove_seq(self._cached.pop(old))

    def extend(self, req_id: str, new_tokens: Sequence[int]) -> None:
        tree = self._local.get(req_id)
        if tree is None:
            raise unknown_request("SuffixProposer.extend", req_id)
        new = _as_list(new_tokens)
        tree.append(0, tree.seqs[0], new)
        sid = self._cached.get(req_id)
        if sid is not None:  # still cached (it may have been evicted while running)
            self._global.append(sid, self._global.seqs[sid], new)

    def stop_request(self, req_id: str) -> None:
        if self._local.pop(req_id, None) is None:
            raise unknown_request("SuffixProposer.stop_request", req_id)
        # the response stays in the global tree until FIFO eviction

    def evict_cached_response(self, req_id: str) -> None:
        sid = self._cached.pop(req_id, None)
        if sid is None:
            raise KeyError(f"SuffixProposer.evict_cached_response: {req_id!r} has no cached "
                           f"response; cached ids are listed by .cached_requests")
        self._global.remove_seq(sid)

    @property
    def active_requests(self) -> list[str]:
        return list(self._local)

    @property
    def cached_requests(self) -> list[str]:
        return list(self._cached)

    # -- drafting ----------------------------------------------------------------------------
    def propose(self, req_ids: Sequence[str], max_tokens: int | Sequence[int]) -> list[list[int]]:
        ks = per_request_k(req_ids, max_tokens)
        return [self.propose_with_probs(r, k)[0] for r, k in zip(req_ids, ks)]

    def propose_with_probs(self, req_id: str, k: int) -> tuple[list[int], list[float]]:
        """Draft for one request plus each token's estimated probability (non-increasing;
        prob_j / prob_{j-1} is the per-position confidence a dynamic-K budget can use)."""
        tree = self._local.get(req_id)
        if tree is None:
            raise unknown_request("SuffixProposer.propose", req_id)
        if k <= 0:
            return [], []
        ctx = tree.seqs[0]
        lt, lp, ls = self._draft(tree, ctx, k)
        if self._cached:
            gt, gp, gs = self._draft(self._global, ctx, k)
            if gs > ls:
                return gt, gp
        return lt, lp

    def _draft(self, tree: _Tree, ctx: list[int], K: int):
        D = self.max_tree_depth
        T = len(ctx)
        mmax = min(T, D) - 1  # match lengths 1 .. mmax (the context window is the last D)
        best_t: list[int] = []
        best_p: list[float] = []
        best = 0.0
        if mmax < 1:
            return best_t, best_p, best
        f, off, pmin = self.max_spec_factor, self.max_spec_offset, self.min_token_prob
        seqs, index = tree.seqs, tree.index
        upper = mmax
        for k in (_LONG, _MID, 1):
            if k > upper:
                continue
            if min(K, int(upper * f + off + 1e-6)) <= best:
                break  # no shorter match can beat `best` (and ties keep the longer one)
            lst = index.get(tuple(ctx[T - k:]))
            if lst is None:
                upper = k - 1
                continue
            window = _LONG_WINDOW if k == _LONG else _WINDOW
            refs = lst[-window:] if len(lst) > window else lst
            # backward match length of each occurrence, capped at `upper`
            scored = []
            for order, (sid, e) in enumerate(refs):
                seq = seqs.get(sid)
                if seq is None:
                    continue  # evicted, not yet compacted
                L = k
                while L < upper and e - L >= 0 and seq[e - L] == ctx[T - 1 - L]:
                    L += 1
                scored.append((L, order, sid, e))
            if not scored:
                upper = k - 1
                continue
            scored.sort(reverse=True)  # longest match first
            n_in = 0  # occurrences with L >= m, a prefix of `scored`
            path_for = -1
            toks: list[int] = []
            cum: list[float] = []
            probs: list[float] = []
            for m in range(upper, k - 1, -1):
                budget = min(K, int(m * f + off + 1e-6))
                if budget <= best:
                    return best_t, best_p, best
                while n_in < len(scored) and scored[n_in][0] >= m:
                    n_in += 1
                if n_in == 0:
                    continue
                cap = min(budget, D - m)
                if path_for != n_in:
                    occ = sorted(scored[:n_in], key=lambda r: r[1])  # oldest first
                    need = min(budget, D - k)
                    toks, probs = _path([(r[2], r[3]) for r in occ], seqs, need, n_in, pmin)
                    cum = []
                    acc = 0.0
                    for p in probs:
                        acc += p
                        cum.append(acc)
                    path_for = n_in
                n = min(cap, len(toks))
                score = cum[n - 1] if n else 0.0
                if score > best:
                    best, best_t, best_p = score, toks[:n], probs[:n]
            upper = k - 1
        return best_t, best_p, best
