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

import gc
from typing import Sequence

from npuspec.runtime.proposer import duplicate_request, per_request_k, unknown_request

_H = 4     # exact count table for strings of up to _H tokens: matches of 1 .. _H - 2 tokens
_LONG = 8  # occurrence index levels: matches >= _LONG tokens, and _H - 1 .. _LONG - 1 tokens
_SEARCH = ((_LONG, 1 << 30), (_H - 1, 1 << 30))  # (n-gram length, most recent occurrences read)
_LEVELS = tuple(sorted(k for k, _ in _SEARCH))


def _as_list(tokens) -> list[int]:
    if hasattr(tokens, "tolist"):
        return tokens.tolist()
    return list(tokens)


class _Tree:
    """Token sequences, the n-gram -> [(seq id, end)] occurrence indexes (insertion order), and
    exact counts of every string of up to _H tokens with each one's most frequent next token."""

    __slots__ = ("seqs", "index", "head", "dead", "live")

    def __init__(self):
        self.seqs: dict[int, list[int]] = {}
        self.index: dict[tuple, list[tuple[int, int]]] = {}
        # s (len < _H) -> [best next token, its count, {next token: count(s + token)}]; the best
        # is the first token to reach the top count (same rule as _path)
        self.head: dict[tuple, list] = {}
        self.dead = 0  # refs in `index` that point at evicted sequences
        self.live = 0

    def add_seq(self, sid: int, tokens: list[int]) -> None:
        """Register `tokens` (a list this tree now shares) and index all of it."""
        new = list(tokens)
        del tokens[:]
        self.seqs[sid] = tokens
        paused = gc.isenabled() and len(new) > 256
        if paused:  # a prompt adds thousands of small acyclic containers; skip GC passes
            gc.disable()
        try:
            self.append(sid, tokens, new)
        finally:
            if paused:
                gc.enable()

    def append(self, sid: int, seq: list[int], new: list[int]) -> None:
        index, head = self.index, self.head
        self.live += len(new)
        for t in new:
            seq.append(t)
            e = len(seq) - 1
            tail = seq[-_LONG:]  # [<= _LONG] the last tokens, t last
            w = len(tail)
            for n in range(1, min(_H, w) + 1):  # count s + t for the strings s before t
                parent = tuple(tail[w - n:w - 1])
                ent = head.get(parent)
                if ent is None:
                    head[parent] = [t, 1, {t: 1}]
                else:
                    ch = ent[2]
                    c = ch[t] = ch.get(t, 0) + 1
                    if c > ent[1]:
                        ent[0], ent[1] = t, c
            ref = (sid, e)
            for n in _LEVELS:
                if n > w:
                    break
                key = tuple(tail[w - n:])
                lst = index.get(key)
                if lst is None:
                    index[key] = [ref]
                else:
                    lst.append(ref)

    def remove_seq(self, sid: int) -> None:
        seq = self.seqs.pop(sid)
        head = self.head
        for e, t in enumerate(seq):  # undo the counts exactly
            for n in range(1, min(_H, e + 1) + 1):
                parent = tuple(seq[e - n + 1:e])
                ent = head[parent]
                ch = ent[2]
                c = ch[t] - 1
                if c:
                    ch[t] = c
                else:
                    del ch[t]
                if ent[0] == t:
                    if not ch:
                        del head[parent]
                    else:  # the first maximum in first-seen order
                        b = max(ch, key=ch.__getitem__)
                        ent[0], ent[1] = b, ch[b]
        self.live -= len(seq)
        self.dead += len(seq)
        if self.dead > max(self.live, 4096):
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


def _age(r):
    return r[1]


def _path(refs, seqs, need: int, denom: int, min_prob: float):
    """Greedy most-frequent continuation after the occurrences `refs` = [(seq id, end)], oldest
    first. Returns (tokens, probs); prob_j = (#refs continuing with t1..tj) / denom. Ties between
    equally frequent tokens go to the one that continued the oldest occurrence (measured on the
    shipped traces: it beats "most recent"; for an edit, the oldest copy is the original)."""
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
        t, c = -1, 0
        for seq, e in cur:  # oldest first: ties go to the token that reached the count first
            q = e + j
            if q < len(seq):
                x = seq[q]
                n = counts[x] = counts.get(x, 0) + 1
                if n > c:
                    t, c = x, n
        if not c:
            break
        p = c / denom
        if p < min_prob:
            break
        toks.append(t)
        probs.append(p)
        cur = [r for r in cur if r[1] + j < len(r[0]) and r[0][r[1] + j] == t]
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
        self._lim: dict[int, tuple[list[int], list[int]]] = {}

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
        lt, lp, ls = self._draft(tree, ctx, k, 0.0, ctx)
        if self._cached:
            # the global tree must score strictly higher to win: search it only above `ls`
            sid = self._cached.get(req_id)
            own = self._global.seqs[sid] if sid is not None else None
            gt, gp, gs = self._draft(self._global, ctx, k, ls, own)
            if gs > ls:
                return gt, gp
        return lt, lp

    def _limits(self, K: int):
        """need[m]: token budget of a match of length m; span[lo][hi]: the most tokens any match
        length in [lo, hi] may draft (budget and depth cap), largest m on ties not needed."""
        lim = self._lim.get(K)
        if lim is None:
            D, f, off = self.max_tree_depth, self.max_spec_factor, self.max_spec_offset
            need = [max(0, min(K, int(m * f + off + 1e-6))) for m in range(D + 1)]
            caps = [min(need[m], D - m) for m in range(D + 1)]
            span = [[max(caps[lo:hi + 1], default=0) for hi in range(D + 1)] for lo in range(D + 1)]
            lim = self._lim[K] = (need, span)
        return lim

    def _draft(self, tree: _Tree, ctx: list[int], K: int, floor: float, own=None):
        """Best (tokens, probs, score) of one tree for the context's tail (see module doc),
        or ([], [], floor) when nothing scores above `floor`. `own` is the request's own
        sequence in this tree, whose tail is the context's tail."""
        T = len(ctx)
        D = self.max_tree_depth
        upper = min(T, D) - 1  # match lengths 1 .. upper
        best_t: list[int] = []
        best_p: list[float] = []
        best = floor
        if upper < 1:
            return best_t, best_p, best
        need, span = self._limits(K)
        pmin, seqs, index = self.min_token_prob, tree.seqs, tree.index
        m_lo = 1  # shortest match that could still beat `best` (need[m] > best)
        while m_lo <= upper and need[m_lo] <= best:
            m_lo += 1
        last_key, last_len = None, 0  # the levels often find the same occurrence set again
        toks: list[int] = []
        probs: list[float] = []
        for k, window in _SEARCH:
            if k > upper:
                continue
            if upper < m_lo:
                break
            lst = index.get(tuple(ctx[T - k:]) if k > 1 else (ctx[-1],))
            if lst is None:
                upper = k - 1
                continue
            refs = lst[-window:] if len(lst) > window else lst
            lo = max(k, m_lo)
            want = ctx[T - upper:]  # the longest match we look for
            scored = []  # (match length, age order, seq id, end) of occurrences with L >= lo
            for order, (sid, e) in enumerate(refs):
                seq = seqs.get(sid)
                if seq is None:
                    continue  # evicted, not yet compacted
                if seq is own and e == len(seq) - 1:
                    continue  # the context's own tail: no continuation, not evidence
                elif e + 1 >= upper and seq[e + 1 - upper:e + 1] == want:
                    L = upper  # one C-level compare settles the common long match
                else:
                    L = k
                    while L < upper and L <= e and seq[e - L] == ctx[T - 1 - L]:
                        L += 1
                if L >= lo:
                    scored.append((L, order, sid, e))
            if not scored:
                upper = k - 1
                continue
            scored.sort(reverse=True)  # longest match first
            n_all = len(scored)
            i = 0
            while i < n_all:
                top = scored[i][0]
                while i < n_all and scored[i][0] >= top:
                    i += 1
                # scored[:i] are the occurrences of every match length m in [bottom, top]
                bottom = scored[i][0] + 1 if i < n_all else lo
                if need[top] <= best:
                    break
                length = min(need[top], D - bottom)
                if i == 1:
                    key = [(scored[0][2], scored[0][3])]
                else:
                    key = [(r[2], r[3]) for r in sorted(scored[:i], key=_age)]  # oldest first
                if key != last_key or (length > last_len and len(toks) == last_len):
                    toks, probs = _path(key, seqs, length, i, pmin)
                    last_key, last_len = key, length
                c = span[bottom][top]
                if c > len(toks):
                    c = len(toks)
                if c:
                    score = sum(probs[:c])
                    if score > best:
                        best, best_t, best_p = score, toks[:c], probs[:c]
                        while m_lo <= upper and need[m_lo] <= best:
                            m_lo += 1
            upper = k - 1
        # matches of 1 .. _H - 2 tokens: read the exact count table, no scan
        head = tree.head
        for m in range(min(upper, _H - 2), 0, -1):
            if need[m] <= best:
                break
            s = tuple(ctx[T - m:])
            ent = head.get(s[:-1])
            total = ent[2].get(s[-1]) if ent is not None else None
            if total and own is not None and len(own) >= m:
                total -= 1  # minus the context's own tail
            if not total:
                continue  # no occurrence of s here
            t_, p_ = [], []
            for _ in range(min(need[m], D - m, _H - m)):
                ent = head.get(s)
                if ent is None:
                    break
                p = ent[1] / total
                if p < pmin:
                    break
                t_.append(ent[0])
                p_.append(p)
                s += (ent[0],)
            score = sum(p_)
            if score > best:
                best, best_t, best_p = score, t_, p_
        return best_t, best_p, best
