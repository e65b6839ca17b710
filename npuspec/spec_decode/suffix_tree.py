"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; Arctic Inference), pure Python: the
count trees and the match search. `SuffixProposerReference` (suffix_reference.py) drives them
per request; it is the reference implementation. The public `SuffixProposer`
(npuspec/spec_decode/suffix.py) runs a C++ port of exactly this
algorithm (kernels/suffix_cpu_source.py) whose drafts and probabilities are bitwise equal to
these (tests/runtime/test_suffix_native.py), and falls back to this class when the port cannot
be compiled. A change to the algorithm here must be made there too.

What it computes (the quantities of Arctic Inference's suffix trees, docs/proposers.md):
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



def _bump(parent: list, t: int, depth: int, ref: int) -> list:
    """parent's child for token t (a node of `depth` tokens) with its count + 1, created when
    first seen; the parent's most frequent next token follows it (the first to reach the top
    count keeps it: replaced only on a larger count). A 3-token node lists where its string
    ends (oldest first), 4-token nodes are leaves."""
    ch = parent[3]
    a = ch.get(t)
    if a is None:
        a = ch[t] = ([1, None, None, {}, [ref]] if depth == 3
                     else [1, None, None, {} if depth < 4 else None])
    else:
        a[0] += 1
        if depth == 3:
            a[4].append(ref)
    if parent[1] != t and (parent[1] is None or a[0] > parent[2][0]):
        parent[1] = t
        parent[2] = a
    return a

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
        # steady state (>= _LONG tokens before each new one): _append_slow's updates, the
        # nodes of the last 0..3 tokens carried in locals, the last _LONG tokens packed in
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
            # token; the 3-token node also lists where the string ends
            ref = base | e
            a = _bump(p0, t, 1, ref)
            b = _bump(p1, t, 2, ref)
            c = _bump(p2, t, 3, ref)
            _bump(p3, t, 4, ref)
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
