"""Exact normal forms, applied to a graph before any verify pattern runs (issue 37, point 1).

Codebases spell one computation many ways: `relu(x)` or `x.clamp(min=0)`, `gather` or advanced
indexing, `keepdim=True` then a squeeze, the row picked before or after an elementwise op. Each
rule here rewrites one family of spellings into the one form the pattern families are traced
with, and only where the two are bit-equal on every input (NaN and -0.0 included) or the rule
states the input domain it checks. A rule is one small module with

    NAME: str                      # the counter suffix: canonical_rewrites.<NAME>
    def apply(graph, flavor) -> int  # rewrites in place; returns how many sites it rewrote
    def undo_untaken(graph) -> int   # optional: a rule that rewrites on trial puts back the
                                     # sites no family took (after every family has run)

and its own exactness test, tests/passes/test_rewrite_<NAME>.py. `normalize` runs RULES in
order; the pass manager calls it after the literal canonicaliser and before the pick rewrite
(manager.py). Adding a rule: write the module, add it to RULES, add its test. Its source enters
the pass manager's uuid through `modules()`, so editing a rule invalidates cached compiles.
"""
from __future__ import annotations

from torch.fx import Graph

from npuspec.passes.rewrites import (columns, gather_rows, k_one, keepdim, leading_dims, nonneg,
                                     scaled_pick, sum_keepdim, take_along, upcast)

# rule modules, in the order they run (take_along first: gather_rows reads its gathers; upcast
# before nonneg, which reads the clamp it writes back)
RULES: tuple = (take_along, scaled_pick, gather_rows, sum_keepdim, upcast, nonneg, keepdim,
                leading_dims, k_one, columns)


def normalize(graph: Graph, flavor: str) -> dict:
    """Run every rule once, in order. -> {rule NAME: sites rewritten} (zeros left out)."""
    done = {}
    for rule in RULES:
        n = rule.apply(graph, flavor)
        if n:
            done[rule.NAME] = done.get(rule.NAME, 0) + n
    if done:
        graph.eliminate_dead_code()
    return done


def undo_untaken(graph: Graph) -> dict:
    """Rules that rewrite on trial (a module-level `undo_untaken`) put back, after every family
    has run, the sites no family took. -> {rule NAME: sites put back} (zeros left out)."""
    done = {}
    for rule in RULES:
        undo = getattr(rule, "undo_untaken", None)
        n = undo(graph) if undo is not None else 0
        if n:
            done[rule.NAME] = n
    return done


def modules() -> tuple:
    """The rule modules, for the pass manager's source hash."""
    return RULES
