"""The pass manager: runs the verify patterns over an ATen graph, supersets first.

    manager = PassManager()                  # default_patterns(), in this order:
        1. greedy_verify   (whole greedy step   -> npuspec::rejection_sample)
        2. sample_verify   (whole sampling step -> npuspec::rejection_sample(target_is_probs=True))
           sample_verify   (the same with the other accept comparisons: `u < r`, `~(u > r)`,
                            `~(u >= r)`; compiled only for a graph that holds one)
        3. greedy_accept   (prefix length       -> npuspec::greedy_accept)
        4. ratio_accept    (standard test       -> npuspec::ratio_accept)
        5. residual        (residual resample   -> npuspec::residual_sample / residual_probs)
        6. given_residual  (a difference made outside the graph, max_fn's frame, or a row with
                            its draft zeroed -> npuspec::residual_probs)
    n = manager.run(graph, flavor="inductor")   # or "aten"

A superset runs first so that a whole greedy step becomes one rejection_sample call instead of
an argmax plus a greedy_accept (and a whole sampling step one call instead of ratio_accept plus
residual_sample). Each family is compiled into its own Inductor
`PatternMatcherPass` per *flavor*: the ATen spelling of a pattern depends on the decomposition
table the graph was traced with (Inductor decomposes softmax, for example), so patterns are
traced with the same table as the graph they run on:

- "inductor": Inductor's table with `fallback_random=True` (so random ops stay the eager ops);
  the manager runs as Inductor's `joint_custom_pre_pass` (see `InductorVerifyPass`).
- "aten": no decompositions; used by the eager lowering on the graph from AOT autograd.

A graph without a cheap necessary condition for any replacement (`could_match`: an argmax or
multinomial, a cumprod, a scan of an accept mask, a small bool mask, a max(d, 0) form) is left
exactly as it came, unread. Before matching, in this order: `canonicalize` rewrites dim/slice literals into one form (both
in the graph and in the traced patterns); `rewrites.normalize` applies the exact normal forms
of passes/rewrites/ (one rule per file; `counters["canonical_rewrites.<rule>"]` counts the
sites of a graph in which a family then matched); `picks.canonical_picks` puts every spelling of
"p at the drafted ids" into the gather form; `prefix.prove_prefix_counts` proves every
accepted-prefix count and rewrites it into the cumprod form. The families then run in up to
four rounds: on the graph with repeated views merged; again with them split
(`canonical.split_views`); for accept masks `ok.cumprod(1)` that nothing counts, with a count
written for each and the mask rebuilt from it (`passes/bare_masks.py`; masks no match took are
put back); and, for counts still unfused whose mask or pick the user's other code also reads,
with private copies of what they are computed from (`passes/shared.py`; copies no match took
merge back); then `residual_proof.prove_recovered` replaces each argmax left whose pointwise
region the check set shows to be a residual race; last, `composed.compose_steps` and
`composed_greedy.compose_greedy` turn a ratio_accept + residual_sample pair (or a greedy_accept)
whose emission the check shows to be the step's into one rejection_sample, and
`composed_ragged.compose_ragged` a race over flat rows plus vllm-ascend's ragged verify around
it into one in the op's ragged mode (`verify_patterns_matched.composed`); then the rules that
rewrite on trial put back every site no family took (`rewrites.undo_untaken`). `counters["verify_patterns_matched"]` moves by the number of
replacements (and `verify_patterns_matched.<family>` per family); a graph in which nothing
matched but which looks like a verify step is named once per source line
(`passes/unmatched.py`, `counters["verify_patterns_unmatched"]`). With NPUSPEC_DEBUG_DUMP set,
each run writes `NNNN_1_before.txt` / `NNNN_2_after.txt` there (numbered per process).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import inspect
import itertools
import logging
import os
import threading
import time
from typing import Optional, Sequence

import torch
from torch._guards import detect_fake_mode
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import disable_fake_tensor_cache
from torch.fx._lazy_graph_module import _LazyGraphModule

from npuspec import counters, envs
from npuspec.passes import (bare_masks, canonical, composed, composed_greedy, composed_ragged,
                            direct_trace, picks, prefix, residual_proof, rewrites, rowlocal,
                            search_memo, shared, trace_store, unmatched)
from npuspec.passes.hashing import source_hash
from npuspec.passes.patterns import VerifyPattern, default_patterns
from npuspec.passes.rewrites import fake_values, nodes
from npuspec.passes.rowlocal import _name
from npuspec.passes.trace_store import trace_canonical  # the patterns' trace_fn

log = logging.getLogger("npuspec.passes")

FLAVORS = ("inductor", "aten")
_dump_seq = itertools.count(1)
_lock = threading.Lock()


def decomp_table(flavor: str) -> dict:
    if flavor == "aten":
        return {}
    assert flavor == "inductor", flavor
    from torch._inductor import config as iconfig
    from torch._inductor.decomposition import select_decomp_table
    with iconfig.patch(fallback_random=True):
        return select_decomp_table()


class _Compiled:
    """One family's spellings registered into a PatternMatcherPass for one flavor."""

    def __init__(self, pattern: VerifyPattern, flavor: str):
        from torch._inductor.pattern_matcher import PatternMatcherPass, register_replacement
        self.uuid = pattern.uuid()
        self.pass_ = PatternMatcherPass(pass_name=f"npuspec_{pattern.name}")
        table = decomp_table(flavor)
        self.names = []
        for sp in pattern.spellings():
            ok = register_replacement(
                sp.search, sp.replace, sp.example(),
                trace_fn=search_memo.SearchMemo(
                    sp.search, trace_canonical,
                    shelf=trace_store.Shelf(flavor, self.uuid, sp.name)),
                pass_dicts=self.pass_,
                extra_check=pattern.extra_check, skip_duplicates=True,
                get_decomp_fn=lambda: table, pattern_name=f"{pattern.name}.{sp.name}",
                scalar_workaround=sp.scalars or None)
            if ok:
                self.names.append(sp.name)


@functools.lru_cache(maxsize=None)
def _compiled(key: tuple) -> _Compiled:
    return _Compiled(_PATTERN_BY_KEY[key], key[1])


_PATTERN_BY_KEY: dict = {}


def compiled(pattern: VerifyPattern, flavor: str) -> _Compiled:
    """Registered patterns, cached by (family uuid, flavor): editing a config recompiles."""
    key = (pattern.uuid(), flavor)
    with _lock:
        _PATTERN_BY_KEY[key] = pattern
        return _compiled(key)


# The last few runs as (flavor, {family: count}, graph text after the passes), newest last:
# what tests and `npuspec` debugging look at to see which ops a compile produced. A graph
# nothing matched is the graph as it came; its text is kept only up to HISTORY_TEXT_NODES
# nodes ("" past it): printing a model forward (SmolLM2's: 2,791 nodes) took ~50-90 ms of
# every compile, for a text nothing reads outside tests.
HISTORY: collections.deque = collections.deque(maxlen=32)
HISTORY_TEXT_NODES = 1000
# Runs and seconds spent in them, totals over the process (`npuspec bench passes` reports the
# time a compile added beside Inductor's compile time for the same graph): the copy, the
# rewrites, the replacements and the copy back together.
TOTALS = {"runs": 0, "seconds": 0.0}


def _remove_noop_ops(graph: torch.fx.Graph) -> None:
    """Inductor's no-op removal (e.g. the full-range slice AOT emits for `n[:, None]`), which
    the traced patterns went through too; it never adds aliasing between inputs and outputs."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops
    if all("val" in n.meta for n in graph.find_nodes(op="placeholder")):
        remove_noop_ops(graph)


# Every pattern's output node is one of these ops, or the prefix proof and the pick rewrite
# (which make one) start from one of them; a graph without any is skipped outright.
_ANCHORS = ("sum", "argmax", "multinomial", "where", "squeeze", "gather", "index", "index_put",
            "max", "min", "cumsum", "cumprod", "cummin")


def _has_anchor(graph: torch.fx.Graph) -> bool:
    return any(n.op == "call_function" and _name(n.target) in _ANCHORS for n in graph.nodes)


# What every replacement needs in the graph as it comes, one of (a model forward has none, so
# its compiles skip the copy, the no-op removal and the rewrites: SmolLM2's forward under
# Inductor's decompositions, 2,885 nodes, cost 0.25-0.37 s a compile with nothing to match):
# - argmax/argmin or multinomial (every token, k_one's argmax), a cumprod (every product
#   tail, vllm-ascend's running products), or a cumsum/cummin/cummax of a mask that compares
#   two tensors (through casts, views, negations and `&`/`|`: the count tails
#   `(~ok).cumsum(-1) < 1`, `.long().cummin(-1)`); HF's forward takes a cumsum of
#   `attention_mask != 0`, a compare with a literal, which is none;
# - a bool [B] or [B, K <= prefix.MAX_K] tensor: the prefix proof's flags, the columns rule's
#   per-column compares, an accept test's mask;
# - max(d, 0) for a residual read without a race (residual_probs): clamp, clamp_min, maximum,
#   relu, or a where whose condition is an order comparison (`d > 0`, before canonical order).
_SIGNALS = ("cumprod", "argmax", "argmin", "multinomial", "clamp", "clamp_min", "maximum", "relu")
_SCANS = ("cumsum", "cummin", "cummax")
_ORDER = ("gt", "ge", "lt", "le")
_COMPARES = ("eq", "ne", "gt", "ge", "lt", "le")
_THROUGH = ("_to_copy", "convert_element_type", "view", "reshape", "unsqueeze", "squeeze",
            "slice", "select", "expand", "clone", "bitwise_not", "logical_not", "bitwise_and",
            "logical_and", "bitwise_or", "logical_or", "neg", "rsub", "sub", "permute",
            "_unsafe_view", "alias")


def _from_compare(x, depth: int = 8) -> bool:
    """x is, through casts, views, negations and `&`/`|`, a comparison of two tensors of rank
    >= 1 (an accept test: drafts == target, ratio >= u), not of a tensor with a literal."""
    if not isinstance(x, torch.fx.Node) or x.op != "call_function" or depth == 0:
        return False
    name = _name(x.target)
    if name in _COMPARES:
        vals = [a.meta.get("val") for a in x.args[:2] if isinstance(a, torch.fx.Node)]
        return len(vals) == 2 and all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in vals)
    if name not in _THROUGH:
        return False
    return any(_from_compare(a, depth - 1) for a in x.args if isinstance(a, torch.fx.Node))


def _signal(n: torch.fx.Node) -> bool:
    if n.op != "call_function":
        return False
    name = _name(n.target)
    if name in _SIGNALS:
        return True
    if name in _SCANS:
        return _from_compare(n.args[0])
    cond = n.args[0] if name == "where" else None
    if isinstance(cond, torch.fx.Node) and _name(cond.target) in _ORDER:
        return True
    v = n.meta.get("val")
    return (isinstance(v, torch.Tensor) and v.dtype == torch.bool
            and (v.dim() == 1 or v.dim() == 2 and isinstance(v.shape[1], int)
                 and v.shape[1] <= prefix.MAX_K))


def could_match(graph: torch.fx.Graph) -> bool:
    """A cheap necessary condition for any replacement (see _SIGNALS); a graph without it is
    lowered exactly as it came, without the copy and the rewrites."""
    return _has_anchor(graph) and any(_signal(n) for n in graph.nodes)


@contextlib.contextmanager
def _uncached_fakes(graph: torch.fx.Graph):
    """The graph's fake mode with its dispatch cache off while the passes run. Each fake value
    the passes compute (a search or replacement trace, a new node's meta) is an op at the
    graph's own new sizes, so a cache lookup misses and the entry made for it is not read
    again. On vLLM v1's step that is ~10 % of the passes' time on a graph after the first (the
    fastest of ten new batch sizes, median of five processes: 40.6 -> 36.0 ms; the first
    graph's 60-ish ms moved within its noise). The values are the same either way."""
    vals = [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        yield
        return
    with disable_fake_tensor_cache(mode):
        yield


def _copy(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A copy of `graph` (node meta included) to dry-run the patterns on; lazy, since it is
    never run (its nodes go back into `graph`), so no Python is generated for it."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(graph, {}))
    return _LazyGraphModule(graph.owning_module or torch.nn.Module(), g)


def _transplant(graph: torch.fx.Graph, src: torch.fx.Graph) -> None:
    """Make `graph` compute what `src` (a rewritten `_copy` of it) computes, in place: its own
    placeholders stay (matched by position), every other node is replaced by a copy of src's,
    meta included. The pass runs once, on the copy, instead of once there and again here."""
    old_ph = graph.find_nodes(op="placeholder")
    new_ph = src.find_nodes(op="placeholder")
    assert len(old_ph) == len(new_ph), (len(old_ph), len(new_ph))
    for n in reversed(list(graph.nodes)):  # users before what they read
        if n.op != "placeholder":
            graph.erase_node(n)
    env = dict(zip(new_ph, old_ph))
    for n in src.nodes:
        if n.op != "placeholder":
            env[n] = graph.node_copy(n, env.__getitem__)


def _dump(graph: torch.fx.Graph, tag: str, seq: int) -> None:
    d = envs.debug_dump()
    if d is None:
        return
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{seq:04d}_{tag}.txt")
    with open(path, "w") as f:
        f.write(str(graph))
    log.info("npuspec: wrote %s", path)


class PassManager:
    """Runs verify-pattern families over a graph in order; see the module docstring."""

    def __init__(self, patterns: Optional[Sequence[VerifyPattern]] = None):
        self.patterns = list(default_patterns() if patterns is None else patterns)
        self.last_rewrites: dict = {}  # {rule: sites} of the last _rewrite (passes/rewrites)

    def run(self, gm_or_graph, flavor: str = "inductor") -> dict:
        """Rewrite in place. Returns {family name: replacements} (families with 0 left out).

        The patterns first run on a copy; the graph itself is touched (no-op removal,
        canonical literals, replacements) only when something matched, so a graph with
        nothing to match is lowered exactly as it came."""
        if flavor not in FLAVORS:
            raise ValueError(f"PassManager.run: flavor={flavor!r} must be one of {FLAVORS}")
        graph = gm_or_graph.graph if isinstance(gm_or_graph, torch.fx.GraphModule) else gm_or_graph
        t0 = time.perf_counter()
        seq = next(_dump_seq) if envs.debug_dump() else 0
        if seq:
            _dump(graph, "1_before", seq)
        found = {}
        if could_match(graph):  # rewritten on a copy: a graph nothing matched stays as it came
            trial = _copy(graph)
            with _uncached_fakes(graph):
                found = self._rewrite(trial.graph, flavor)
            if found:
                _transplant(graph, trial.graph)
        for name, n in found.items():
            counters.bump(f"verify_patterns_matched.{name}", n)
        if found:
            for name, n in self.last_rewrites.items():
                counters.bump(f"canonical_rewrites.{name}", n)
            counters.bump("verify_patterns_matched", sum(found.values()))
            if graph.owning_module is not None:
                graph.owning_module.recompile()
        else:  # a verify-like step left as written is named once (passes/unmatched.py)
            unmatched.note_unmatched(graph)
        if seq:
            _dump(graph, "2_after", seq)
        text = str(graph) if found or len(graph.nodes) <= HISTORY_TEXT_NODES else ""
        HISTORY.append((flavor, dict(found), text))
        TOTALS["runs"] += 1
        TOTALS["seconds"] += time.perf_counter() - t0
        log.info("npuspec passes (%s): %s", flavor, found or "no verify pattern matched")
        return found

    def _rewrite(self, graph: torch.fx.Graph, flavor: str) -> dict:
        _remove_noop_ops(graph)
        canonical.canonicalize(graph)  # repeated views merged: shared inputs match
        self.last_rewrites = rewrites.normalize(graph, flavor)  # exact normal forms
        if self.last_rewrites:
            canonical.canonicalize(graph)  # views the rules made merge with the user's
        if picks.canonical_picks(graph, flavor):  # p[b, k, ids], reshape-for-squeeze -> gather
            canonical.canonicalize(graph)  # the new views merge with the user's
        prefix.prove_prefix_counts(graph, flavor)  # every accepted-prefix spelling -> one
        found = {}
        for views in ("merged", "split"):
            if views == "split":  # a merged view shared with outside code then blocks nothing
                canonical.split_views(graph)
            self._apply_families(graph, flavor, found)
        self._bare_mask_round(graph, flavor, found)
        self._shared_round(graph, flavor, found)
        proven = residual_proof.prove_recovered(graph)  # what no residual spelling took
        if proven:
            found["residual_proof"] = proven
        # the narrow ops and the user's emission -> one call
        steps = (composed.compose_steps(graph, flavor)
                 + composed_greedy.compose_greedy(graph, flavor)
                 + composed_ragged.compose_ragged(graph, flavor))
        if steps:
            found["composed"] = steps
        for name, n in rewrites.undo_untaken(graph).items():  # trial sites no family took
            self.last_rewrites[name] -= n
            if not self.last_rewrites[name]:
                del self.last_rewrites[name]
        if found:
            # a replacement goes before its pattern's first output; one whose input is made
            # later (an RNG draw after the ratio test) moves down after it (see
            # patterns_sample._late_inputs_ok); a sorted graph is left as it is
            from torch._inductor.pattern_matcher import stable_topological_sort
            stable_topological_sort(graph)
            graph.eliminate_dead_code()
            graph.lint()
        return found

    def _apply_families(self, graph: torch.fx.Graph, flavor: str, found: dict) -> None:
        for p in self.patterns:
            if not p.applies(graph):
                continue
            n = compiled(p, flavor).pass_.apply(graph)
            if n:
                found[p.name] = found.get(p.name, 0) + n

    def _bare_mask_round(self, graph: torch.fx.Graph, flavor: str, found: dict) -> None:
        """A round for accept masks the user never counts (vLLM v1's greedy `forward_native`):
        each gets a count and is rebuilt from it, the families run once more, and the masks
        whose count no family took are put back as written (passes/bare_masks.py)."""
        made = bare_masks.add_counts(graph, flavor)
        if made:
            self._apply_families(graph, flavor, found)
            bare_masks.undo_unmatched(graph, made)

    def _shared_round(self, graph: torch.fx.Graph, flavor: str, found: dict) -> None:
        """A third round for the counts still unfused whose mask or pick the user's other code
        also reads: each gets private copies of what it is computed from, the families run
        once more, and the copies no match took merge back into their originals
        (passes/shared.py). Skipped outright when no count of a scan is left."""
        if not shared.anchors(graph):
            return
        canonical.canonicalize(graph)  # views merged again, as the patterns were traced
        copies = shared.privatize(graph)
        if copies:
            self._apply_families(graph, flavor, found)
            shared.merge_back(graph, copies)

    def uuid(self) -> str:
        h = hashlib.sha256(source_hash(inspect.getmodule(PassManager), canonical, picks, prefix,
                                       rowlocal, unmatched, rewrites, shared, bare_masks,
                                       residual_proof, composed, composed_greedy,
                                       composed_ragged, search_memo, trace_store,
                                       direct_trace, fake_values, nodes,
                                       *rewrites.modules()).encode())
        for p in self.patterns:
            h.update(p.uuid().encode())
        return h.hexdigest()


class InductorVerifyPass(CustomGraphPass):
    """The manager as Inductor's `joint_custom_pre_pass`.

    It runs on the graph AOT autograd traced with Inductor's decompositions, before Inductor's
    own joint/post-grad pattern passes rewrite it (those would otherwise fold and reorder the
    very ops our patterns look for). `uuid()` enters Inductor's FX graph cache key, so editing a
    pass's source or config invalidates cached compiles, and identical passes hit the cache.
    `uuid_extra` joins it: what else a cached compile must agree on (the lowering gives how it
    records pass counts, compilation/pass_counts.record_uuid; a change to it recompiles cached
    graphs once, recording again, where hits would find no record and count 0)."""

    runs = 0  # calls in this process: a compile that leaves it unchanged hit Inductor's cache

    def __init__(self, manager: Optional[PassManager] = None, uuid_extra: str = ""):
        self.manager = manager or PassManager()
        self.uuid_extra = uuid_extra

    def __call__(self, graph: torch.fx.Graph) -> None:
        InductorVerifyPass.runs += 1
        self.manager.run(graph, flavor="inductor")

    def uuid(self) -> str:
        return hashlib.sha256((self.manager.uuid() + self.uuid_extra).encode()).hexdigest()


def run_passes(gm: torch.fx.GraphModule, flavor: str = "aten",
               manager: Optional[PassManager] = None) -> dict:
    return (manager or PassManager()).run(gm, flavor=flavor)
