"""`SuffixProposerReference`: suffix decoding per request over the count trees of
suffix_tree.py, in pure Python. It is the oracle of the compiled `SuffixProposer`
(npuspec/spec_decode/suffix.py), and what that runs when its library cannot be built; see
suffix_tree.py for what it computes.
"""
from __future__ import annotations

from typing import Sequence

from npuspec.spec_decode.base import Proposer, duplicate_request, per_request_k, unknown_request
from npuspec.spec_decode.suffix_tree import (_H, _LONG, _MASK, _SEARCH, _WORK, _Tree, _age,
                                             _as_list, _budget, _check_ids, _past_table, _path,
                                             check_params)


class SuffixProposerReference(Proposer):
    """The pure-Python suffix proposer: the oracle of the compiled `SuffixProposer`, and what
    that runs when its library cannot be built."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_spec_offset: float = 0.0):
        check_params(max_tree_depth, max_cached_requests, max_spec_factor, min_token_prob,
                     max_spec_offset)
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self.max_spec_offset = float(max_spec_offset)
        self._local: dict[str, _Tree] = {}      # req_id -> tree over its prompt + output
        self._global = _Tree(evictable=True)    # responses, FIFO order = self._cached order
        self._cached: dict[str, int] = {}       # req_id -> seq id in the global tree
        self._next_sid = 0
        self._lim: dict[int, tuple[list[int], list[int]]] = {}

    # -- request lifecycle -------------------------------------------------------------------
    def start_request(self, req_id: str, prompt: Sequence[int]) -> None:
        if req_id in self._local:
            raise duplicate_request("SuffixProposer.start_request", req_id)
        toks = _as_list(prompt)
        _check_ids("SuffixProposer.start_request", toks)
        tree = _Tree()
        tree.add_seq(0, toks)
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
        new = new_tokens if type(new_tokens) is list else _as_list(new_tokens)  # not copied
        if new and (min(new) < 0 or max(new) > _MASK):
            _check_ids("SuffixProposer.extend", new)
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

    def forget_responses(self) -> None:
        for r in list(self._cached):
            self.evict_cached_response(r)

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

    def propose_batch_with_probs(self, req_ids: Sequence[str], max_tokens: int | Sequence[int]
                                 ) -> list[tuple[list[int], list[float]]]:
        """`propose_with_probs` for each request: [(tokens, probs), ...]."""
        ks = per_request_k(req_ids, max_tokens)
        return [self.propose_with_probs(r, k) for r, k in zip(req_ids, ks)]

    def propose_with_probs(self, req_id: str, k: int) -> tuple[list[int], list[float]]:
        """Draft for one request plus each token's estimated probability (non-increasing;
        prob_j / prob_{j-1} is the per-position confidence a dynamic-K budget can use)."""
        tree = self._local.get(req_id)
        if tree is None:
            raise unknown_request("SuffixProposer.propose", req_id)
        if k <= 0:
            return [], []
        ctx = tree.seqs[0]
        qk = tree.state[0]  # packed keys of the context's last 0.._LONG tokens
        lt, lp, ls = self._draft(tree, ctx, qk, k, 0.0, ctx)
        if self._cached:
            # the global tree must score strictly higher to win: search it only above `ls`
            sid = self._cached.get(req_id)
            own = self._global.seqs[sid] if sid is not None else None
            gt, gp, gs = self._draft(self._global, ctx, qk, k, ls, own)
            if gs > ls:
                return gt, gp
        return lt, lp

    def _limits(self, K: int):
        """need[m]: token budget of a match of length m; span[lo][hi]: the most tokens any match
        length in [lo, hi] may draft (budget and depth cap), largest m on ties not needed."""
        lim = self._lim.get(K)
        if lim is None:
            D, f, off = self.max_tree_depth, self.max_spec_factor, self.max_spec_offset
            need = [_budget(m * f + off + 1e-6, K) for m in range(D + 1)]
            caps = [min(need[m], D - m) for m in range(D + 1)]
            span = [[0] * (D + 1) for _ in range(D + 1)]
            for lo in range(D + 1):
                run = 0
                for hi in range(lo, D + 1):
                    run = run if run > caps[hi] else caps[hi]
                    span[lo][hi] = run
            lim = self._lim[K] = (need, span)
        return lim

    def _draft(self, tree: _Tree, ctx: list[int], qk: list[int], K: int, floor: float, own=None):
        """Best (tokens, probs, score) of one tree for the context's tail (see module doc),
        or ([], [], floor) when nothing scores above `floor`. `own` is the request's own
        sequence in this tree, whose tail is the context's tail."""
        T = len(ctx)
        D = self.max_tree_depth
        upper = min(T, D) - 1  # match lengths 1 .. upper
        best_t, best_p, best = [], [], floor
        if upper < 1:
            return best_t, best_p, best
        need, span = self._limits(K)
        pmin, seqs, index = self.min_token_prob, tree.seqs, tree.index
        m_lo = _shortest_useful(1, upper, need, best)
        last_key, last_len = None, 0  # the levels often find the same occurrence set again
        toks, probs, work = [], [], 0
        for k, window in _SEARCH:
            if k > upper:
                continue
            if upper < m_lo or work > _WORK:
                break
            lst = index.get(qk[k]) if k == _LONG else _trigram_list(tree, ctx)
            if lst is None:
                upper = k - 1
                continue
            refs = lst[-window:] if len(lst) > window else lst
            lo = max(k, m_lo)
            scored = _match_lengths(refs, seqs, own, ctx, k, upper, lo)
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
                if need[top] <= best or work > _WORK:
                    break
                length = min(need[top], D - bottom)
                key = _occurrence_key(scored, i)
                if key != last_key or (length > last_len and len(toks) == last_len):
                    toks, probs = _path(key, seqs, length, i, pmin)
                    work += i * length
                    last_key, last_len = key, length
                c = min(span[bottom][top], len(toks))
                if c:
                    score = sum(probs[:c])
                    if score > best:
                        best, best_t, best_p = score, toks[:c], probs[:c]
                        m_lo = _shortest_useful(m_lo, upper, need, best)
            upper = k - 1
        # matches of 1 .. _H - 2 tokens: read the exact count table, no scan
        return _short_matches(tree, ctx, own, need, min(upper, _H - 2), D, pmin,
                              best, best_t, best_p)


def _shortest_useful(m: int, upper: int, need, best: float) -> int:
    """The shortest match length from m on that could still beat `best` (need[m] > best)."""
    while m <= upper and need[m] <= best:
        m += 1
    return m


def _occurrence_key(scored: list, i: int) -> list:
    """(seq id, end) of the first i scored occurrences, oldest first: the path's identity."""
    if i == 1:
        return [(scored[0][2], scored[0][3])]
    return [(r[2], r[3]) for r in sorted(scored[:i], key=_age)]


def _trigram_list(tree: _Tree, ctx: list[int]):
    """The occurrence list of the context's last 3 tokens (kept in its depth-3 trie node)."""
    T = len(ctx)
    node = tree.root
    for i in range(T - 3, T):
        node = node[3].get(ctx[i])
        if node is None:
            return None
    return node[4]


def _match_lengths(refs, seqs, own, ctx: list[int], k: int, upper: int, lo: int) -> list:
    """(match length L, age order, seq id, end) of the occurrences `refs` whose match with the
    context's tail is at least `lo` tokens (at most `upper`)."""
    T = len(ctx)
    want = ctx[T - upper:]  # the longest match we look for
    scored = []
    for order, ref in enumerate(refs):
        sid = ref >> 32
        e = ref & 0xFFFFFFFF
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
    return scored


def _short_matches(tree: _Tree, ctx: list[int], own, need, top: int, D: int, pmin: float,
                   best: float, best_t: list[int], best_p: list[float]):
    """Matches of `top` .. 1 tokens from the exact count table, against the best so far.
    -> the new best (tokens, probs, score)."""
    T = len(ctx)
    for m in range(top, 0, -1):
        if need[m] <= best:
            break
        node = tree.root
        for i in range(T - m, T):  # the trie node of the context's last m tokens
            node = node[3].get(ctx[i])
            if node is None:
                break
        total = node[0] if node is not None else 0
        if total and own is not None and len(own) >= m:
            total -= 1  # minus the context's own tail
        if not total:
            continue  # no occurrence of s here
        t_, p_ = [], []
        steps = min(need[m], D - m)
        for _ in range(min(steps, _H - m)):
            b = node[1]
            if b is None:
                break
            node = node[2]
            p = node[0] / total
            if p < pmin:
                break
            t_.append(b)
            p_.append(p)
        if len(t_) == _H - m < steps:  # past the table: walk the occurrences (Arctic's budget)
            more_t, more_p = _past_table(tree, ctx[T - m:] + t_, steps - len(t_), total, pmin)
            t_ += more_t
            p_ += more_p
        score = sum(p_)
        if score > best:
            best, best_t, best_p = score, t_, p_
    return best_t, best_p, best
