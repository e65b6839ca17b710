"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; Arctic Inference), pure Python.

`SuffixProposerReference` below is the reference implementation. The public `SuffixProposer`
(npuspec/runtime/suffix_native.py; also importable from here) runs a C++ port of exactly this
algorithm (kernels/suffix_cpu_source.py) whose drafts and probabilities are bitwise equal to
these (tests/runtime/test_suffix_native.py), and falls back to this class when the port cannot
be compiled. A change to the algorithm here must be made there too.

What it computes (the quantities of Arctic Inference's suffix trees, DESIGN.md §4):
  * two "trees": one per request over its own tokens (prompt + what it emitted so far), and one
    global tree over the responses of previous and running requests, FIFO-evicted once more than
    `max_cached_requests` responses are cached (0 disables the global tree);
  * count(s) = occurrences of the token string s in a tree, not counting the context's own tail
    (it has no continuation, so it is no evidence; Arctic counts it, which halves every
    probability of a string seen once before -- leaving it out measured better on all K);
  * for the last m tokens s of the context (m = 1 .. min(len, depth) - 1): follow the most frequent
    continuation t1, t2, ... where token j has probability count(s t1..tj) / count(s) (the running
    product of child/parent count ratios) while it stays >= min_token_prob, for at most
    min(K, floor(m * max_spec_factor + max_spec_offset)) tokens and m + j <= max_tree_depth;
  * score = the sum of those probabilities; the best m wins (ties: the longer match), and the
    better tree wins (ties: the request's own tree).
Ties between equally frequent next tokens go to the token that reached that count first (time
order); on the shipped traces this beat both "most recent" and "oldest occurrence".

How (why this is not a pointer-based suffix tree): a Python suffix tree with counts touches up to
`max_tree_depth` nodes per appended token (every suffix ending there), ~20 us per token per tree
in CPython. Instead each tree keeps its token sequences and
  * exact counts of every string of up to _H = 4 tokens, with each one's most frequent next token
    (a trie: a token updates one node per length, found by a small-int look-up from the previous
    token's nodes -- big-int dict look-ups were the cost): matches of 1-2 tokens read it directly;
  * occurrence indexes (3-gram and 8-gram ending at each position -> where; the 3-gram's list
    sits in its depth-3 trie node): `propose` finds the occurrences of a 3..7-token (8+-token)
    match through the 3-gram (8-gram) index, extends each backwards to its full match length,
    and derives the counts above from those occurrences.
The search walks m from long to short and stops once min(K, m * factor + offset) cannot beat the
best score so far, so a confident long match never reads the larger short-match sets. Results
equal a brute-force scan of every occurrence (tests/runtime/test_proposers.py), with a documented
limit: on pathological contexts (an n-gram seen more
than 256 times, e.g. a long run of one token) only its 256 most recent occurrences are read and
the search stops after _WORK occurrence-tokens, so propose stays bounded (~1 ms worst seen).
"""
from __future__ import annotations

import gc
import math
from typing import Sequence

from npuspec.runtime.proposer import duplicate_request, per_request_k, unknown_request

_H = 4     # exact count table for strings of up to _H tokens: matches of 1 .. _H - 2 tokens
_LONG = 8  # occurrence index levels: matches >= _LONG tokens, and _H - 1 .. _LONG - 1 tokens
# (n-gram length, most recent occurrences read); the windows and _WORK only bind on pathological
# contexts (a run of one token, boilerplate seen thousands of times): they bound propose's cost
_SEARCH = ((_LONG, 256), (_H - 1, 256))
_WORK = 2048  # occurrences x tokens walked by _path per tree and propose; then shorter matches
#               are skipped (the exact 1..2-token table still answers)
_LEVELS = tuple(sorted(k for k, _ in _SEARCH))
_COMPACT_MIN = 4096  # the global tree drops evicted references once they outnumber both
#                      this and the live tokens (until then windows still count them)
_B = 32  # bits per token in a packed string key: key(s + t) = key(s) << _B | t, key(()) = 1
_MASK = (1 << _B) - 1
_HJ = [1 << (_B * j) for j in range(_LONG + 1)]  # key(s) = _HJ[len(s)] | packed tokens of s
_MJ = [h - 1 for h in _HJ]  # the packed tokens of the last j tokens of a key: key & _MJ[j]
_H3, _H8, _M3, _M8 = _HJ[3], _HJ[_LONG], _MJ[3], _MJ[_LONG]
assert _H == 4 and _LONG == 8 and _LEVELS == (_H - 1, _LONG), "append assumes these"


def _as_list(tokens) -> list[int]:
    if hasattr(tokens, "tolist"):
        return tokens.tolist()
    return list(tokens)


def _key(s: Sequence[int]) -> int:
    """The packed key of a token string (tests and debugging)."""
    k = 1
    for t in s:
        k = (k << _B) | t
    return k


def _check_ids(where: str, toks: list[int]) -> None:
    if toks and (min(toks) < 0 or max(toks) > _MASK):
        bad = min(toks) if min(toks) < 0 else max(toks)
        raise ValueError(f"{where}: token id {bad} is outside [0, 2**{_B}); pass the model's "
                         "token ids (non-negative ints)")


class _Tree:
    """Token sequences, a count trie over every string of 1.._H tokens, and the _LONG-token
    occurrence index keyed by packed strings (a 1 bit, then _B bits per token; insertion
    order). A trie node is [occurrences, the next token that reached the top count first
    (None: none yet), that child's node, {next token: child node} in first-seen order (None at
    depth _H)], and at depth _H - 1 also the [sid << 32 | end] of every occurrence, oldest
    first (the _H-1-token index). A token's update reads and writes one node per length, found from the
    node of the previous token one length shorter (carried along) with a small-int lookup: on
    4096-token contexts the dict lookups, not the bytecodes, are the cost."""

    __slots__ = ("seqs", "state", "tails", "index", "root", "evictable", "dead", "live")

    def __init__(self, evictable: bool = False):
        self.seqs: dict[int, list[int]] = {}
        self.state: dict[int, list[int]] = {}  # sid -> [key of its last j tokens, j = 0.._LONG]
        self.tails: dict[int, list[list]] = {}  # sid -> trie nodes of its last 0.._H-1 tokens
        self.index: dict[int, list[int]] = {}  # 8-gram key -> [sid << 32 | end position]
        self.root: list = [0, None, None, {}]  # the empty string
        self.evictable = evictable  # only a tree that evicts may remove_seq
        self.dead = 0  # refs in the indexes that point at evicted sequences
        self.live = 0

    def _walk(self):
        """(packed key, node) of the root and every trie node (tests and debugging)."""
        todo = [(1, self.root)]
        while todo:
            key, node = todo.pop()
            yield key, node
            if node[3]:
                todo += [((key << _B) | t, kid) for t, kid in node[3].items()]

    # read-only views for tests and debugging
    @property
    def cnt(self) -> dict[int, int]:
        return {k: n[0] for k, n in self._walk() if k != 1}

    @property
    def best(self) -> dict[int, int]:
        return {k: n[1] for k, n in self._walk() if n[1] is not None}

    @property
    def kids(self) -> dict[int, list[int]] | None:
        if not self.evictable:
            return None
        return {k: list(n[3]) for k, n in self._walk() if n[3]}

    def add_seq(self, sid: int, tokens: list[int]) -> None:
        """Register `tokens` (a list this tree now shares) and index all of it."""
        new = list(tokens)
        del tokens[:]
        self.seqs[sid] = tokens
        self.state[sid] = [1] + [0] * _LONG
        self.tails[sid] = [self.root]
        paused = gc.isenabled() and len(new) > 256
        if paused:  # a prompt adds many small objects, none cyclic; skip the GC passes
            gc.disable()
        try:
            self.append(sid, tokens, new)
        finally:
            if paused:
                gc.enable()

    def append(self, sid: int, seq: list[int], new: list[int]) -> None:
        self.live += len(new)
        if len(seq) < _LONG:  # the first tokens of a sequence: not all keys exist yet
            head = new[:_LONG - len(seq)]
            self._append_slow(sid, seq, head)
            new = new[len(head):]
            if not new:
                return
        # steady state (>= _LONG tokens before each new one): _append_slow's updates unrolled,
        # the nodes of the last 0..3 tokens carried in locals, the last _LONG tokens packed in
        # `w`; the state lists are rewritten once at the end
        index = self.index
        index_get = index.get
        st = self.state[sid]
        tl = self.tails[sid]
        p0, p1, p2, p3 = tl
        w = st[_LONG] & _M8
        e = len(seq)
        seq += new
        base = sid << 32
        B, M8, H8 = _B, _M8, _H8
        for t in new:
            # per length: the string's node (count + 1), then its parent's most frequent next
            # token (the first to reach the top count keeps it: replace only on a larger count)
            ch = p0[3]
            a = ch.get(t)
            if a is None:
                a = ch[t] = [1, None, None, {}]
            else:
                a[0] += 1
            if p0[1] != t and (p0[1] is None or a[0] > p0[2][0]):
                p0[1] = t
                p0[2] = a
            ch = p1[3]
            b = ch.get(t)
            if b is None:
                b = ch[t] = [1, None, None, {}]
            else:
                b[0] += 1
            if p1[1] != t and (p1[1] is None or b[0] > p1[2][0]):
                p1[1] = t
                p1[2] = b
            ch = p2[3]
            c = ch.get(t)
            ref = base | e
            if c is None:  # a 3-token node also lists where the string ends (oldest first)
                c = ch[t] = [1, None, None, {}, [ref]]
            else:
                c[0] += 1
                c[4].append(ref)
            if p2[1] != t and (p2[1] is None or c[0] > p2[2][0]):
                p2[1] = t
                p2[2] = c
            ch = p3[3]
            d = ch.get(t)
            if d is None:
                d = ch[t] = [1, None, None, None]
            else:
                d[0] += 1
            if p3[1] != t and (p3[1] is None or d[0] > p3[2][0]):
                p3[1] = t
                p3[2] = d
            p1, p2, p3 = a, b, c
            # the 8-gram occurrence index (the 3-gram's is its trie node, above)
            w = ((w << B) | t) & M8
            n = H8 | w
            lst = index_get(n)
            if lst is None:
                index[n] = [ref]
            else:
                lst.append(ref)
            e += 1
        tl[1], tl[2], tl[3] = p1, p2, p3
        st[1:] = [_HJ[1] | (w & _MJ[1]), _HJ[2] | (w & _MJ[2]), _H3 | (w & _M3),
                  _HJ[4] | (w & _MJ[4]), _HJ[5] | (w & _MJ[5]), _HJ[6] | (w & _MJ[6]),
                  _HJ[7] | (w & _MJ[7]), _H8 | w]

    def _append_slow(self, sid: int, seq: list[int], new: list[int]) -> None:
        """The general per-token update (any position; `append` uses it for the first _LONG
        tokens of a sequence, where fewer than _LONG keys end at each token)."""
        index = self.index
        st = self.state[sid]
        tl = self.tails[sid]  # trie nodes of the last 0 .. min(len, _H - 1) tokens
        base = sid << 32
        for t in new:
            e = len(seq)
            seq.append(t)
            top = e + 1 if e < _LONG else _LONG
            # keys[j] = key of the last j tokens, now ending with t; its parent (the j - 1
            # tokens before t) is the old st[j - 1], its parent's node tl[j - 1]
            keys = [(k << _B) | t for k in st[:top]]  # keys[j - 1] is for length j
            cur = [self.root]
            for j in range(top if top < _H else _H):
                parent = tl[j]
                ch = parent[3]
                node = ch.get(t)
                if node is None:
                    node = ch[t] = [1, None, None, {} if j < _H - 1 else None]
                    if j == _H - 2:  # a 3-token node also lists where the string ends
                        node.append([base | e])
                else:
                    node[0] += 1
                    if j == _H - 2:
                        node[4].append(base | e)
                if parent[1] != t and (parent[1] is None or node[0] > parent[2][0]):
                    parent[1] = t
                    parent[2] = node
                cur.append(node)
            tl[:] = cur[:_H]
            st[1:top + 1] = keys
            if top == _LONG:
                lst = index.get(keys[_LONG - 1])
                if lst is None:
                    index[keys[_LONG - 1]] = [base | e]
                else:
                    lst.append(base | e)

    def remove_seq(self, sid: int) -> None:
        seq = self.seqs.pop(sid)
        del self.state[sid], self.tails[sid]
        assert self.evictable, "only the global tree evicts"
        tl = [self.root]  # nodes of the last 0.._H-1 tokens (kept after their count hits 0)
        for e, t in enumerate(seq):  # replay the nodes and undo the counts exactly
            top = e + 1 if e < _H else _H
            cur = [self.root]
            for j in range(top):
                parent = tl[j]
                ch = parent[3]
                node = ch[t]
                node[0] -= 1
                if not node[0]:
                    del ch[t]
                if parent[1] == t:  # re-pick: the first maximum in first-seen order
                    if ch:
                        x = max(ch, key=lambda x: ch[x][0])
                        parent[1], parent[2] = x, ch[x]
                    else:
                        parent[1] = parent[2] = None
                cur.append(node)
            tl = cur[:_H]
        self.live -= len(seq)
        self.dead += len(seq)
        if self.dead > max(self.live, _COMPACT_MIN):
            self._compact()

    def _compact(self) -> None:
        seqs = self.seqs
        new = {}
        for key, lst in self.index.items():
            kept = [r for r in lst if r >> 32 in seqs]
            if kept:
                new[key] = kept
        self.index = new
        for a in self.root[3].values():  # the 3-token nodes' occurrence lists
            for b in a[3].values():
                for c in b[3].values():
                    c[4] = [r for r in c[4] if r >> 32 in seqs]
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


def _budget(x: float, K: int) -> int:
    """max(0, min(K, int(x))) without int()'s OverflowError when m * f overflows to inf."""
    return K if x >= K else (int(x) if x >= 1 else 0)


def _path(refs, seqs, need: int, denom: int, min_prob: float):
    """Greedy most-frequent continuation after the occurrences `refs` = [(seq id, end)], oldest
    first. Returns (tokens, probs); prob_j = (#refs continuing with t1..tj) / denom. Ties between
    equally frequent tokens go to the one that reached that count first, walking the
    occurrences oldest first (the same rule as the count table's `best`)."""
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


def _past_table(tree: _Tree, s: list[int], need: int, denom: int, min_prob: float):
    """The continuation of a short match s0 + its table draft, `s` (_H tokens), past the count
    table: the occurrences of s are those of its last _H - 1 tokens (the 3-gram index, its
    _SEARCH window) preceded by s[0]; `_path` over them, probabilities over `denom` = the
    count of the match itself, so they continue the table's running ratios."""
    node = tree.root
    for t in s[1:]:
        node = node[3].get(t)
        if node is None:
            return [], []
    lst = node[4]
    window = _SEARCH[1][1]
    refs, seqs, first = [], tree.seqs, s[0]
    for ref in (lst[-window:] if len(lst) > window else lst):  # oldest first
        sid, e = ref >> 32, ref & 0xFFFFFFFF
        seq = seqs.get(sid)
        if seq is not None and e >= _H - 1 and seq[e - _H + 1] == first:
            refs.append((sid, e))
    if not refs:
        return [], []
    return _path(refs, seqs, need, denom, min_prob)


def check_params(max_tree_depth, max_cached_requests, max_spec_factor, min_token_prob,
                 max_spec_offset) -> None:
    """The constructor checks both implementations share (same errors, same messages)."""
    if not isinstance(max_tree_depth, int) or isinstance(max_tree_depth, bool) \
            or max_tree_depth < 1:
        raise ValueError(f"SuffixProposer: max_tree_depth={max_tree_depth!r} must be an "
                         "int >= 1 (default 24)")
    if not isinstance(max_cached_requests, int) or isinstance(max_cached_requests, bool) \
            or max_cached_requests < 0:
        raise ValueError(f"SuffixProposer: max_cached_requests={max_cached_requests!r} must "
                         "be an int >= 0 (0 disables the global tree; default 10000)")
    # finite: an infinite factor or offset made int(m * f + off) raise inside propose
    if not isinstance(max_spec_factor, (int, float)) or not 0 < max_spec_factor < math.inf:
        raise ValueError(f"SuffixProposer: max_spec_factor={max_spec_factor!r} must be a "
                         "finite number > 0 (default 1.0)")
    if not isinstance(min_token_prob, (int, float)) or not 0 <= min_token_prob <= 1:
        raise ValueError(f"SuffixProposer: min_token_prob={min_token_prob!r} must be in "
                         "[0, 1] (default 0.1)")
    if not isinstance(max_spec_offset, (int, float)) or not math.isfinite(max_spec_offset):
        raise ValueError(f"SuffixProposer: max_spec_offset={max_spec_offset!r} must be a "
                         "finite number (default 0.0)")


class SuffixProposerReference:
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
        work = 0
        for k, window in _SEARCH:
            if k > upper:
                continue
            if upper < m_lo or work > _WORK:
                break
            if k == _LONG:
                lst = index.get(qk[k])
            else:  # the 3-gram's occurrences are listed in its trie node
                lst = tree.root[3].get(ctx[T - 3])
                if lst is not None:
                    lst = lst[3].get(ctx[T - 2])
                    if lst is not None:
                        lst = lst[3].get(ctx[T - 1])
                        if lst is not None:
                            lst = lst[4]
            if lst is None:
                upper = k - 1
                continue
            refs = lst[-window:] if len(lst) > window else lst
            lo = max(k, m_lo)
            want = ctx[T - upper:]  # the longest match we look for
            scored = []  # (match length, age order, seq id, end) of occurrences with L >= lo
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
                if i == 1:
                    key = [(scored[0][2], scored[0][3])]
                else:
                    key = [(r[2], r[3]) for r in sorted(scored[:i], key=_age)]  # oldest first
                if key != last_key or (length > last_len and len(toks) == last_len):
                    toks, probs = _path(key, seqs, length, i, pmin)
                    work += i * length
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
        for m in range(min(upper, _H - 2), 0, -1):
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
                more_t, more_p = _past_table(tree, ctx[T - m:] + t_, steps - len(t_), total,
                                             pmin)
                t_ += more_t
                p_ += more_p
            score = sum(p_)
            if score > best:
                best, best_t, best_p = score, t_, p_
        return best_t, best_p, best


def __getattr__(name):
    # the public SuffixProposer (compiled, falling back to the reference above) lives in
    # suffix_native, which imports this module: a lazy attribute keeps the import acyclic
    if name == "SuffixProposer":
        from npuspec.runtime.suffix_native import SuffixProposer
        return SuffixProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
