"""Row locality through `cat` (passes/rowlocal.py): MLX's `.index(False)` count.

mlx-examples counts the accepted drafts as `(accept.tolist() + [False]).index(False)`; batched,
that is the argmax of `cat([ok, False column], 1) == False`. The prefix proof evaluates it on
every mask, but it is rewritten only when `row_local` shows that row b reads row b of `ok`
alone; a `cat` along a non-row dim of local and one-valued operands does. A `cat` along the
row dim, or one with a constant column that varies by row, is refused."""
import pytest
import torch

from npuspec.passes import prefix, rowlocal
from passes_helpers import three_way
from test_row_local import _count, _flag, aten_graph, run_graph


def index_false(ok):  # mlx-examples' `.index(False)`, batched
    flags = torch.cat([ok, torch.zeros_like(ok[:, :1])], dim=1)
    return torch.eq(flags, False).int().argmax(dim=1)


def index_false_int(ok):  # int32 flags, dim -1, a float argmax (vLLM v1's first zero)
    flags = torch.cat([ok.int(), torch.zeros_like(ok[:, :1], dtype=torch.int32)], dim=-1)
    return (flags == 0).float().argmax(-1)


def index_false_full(ok):  # the column made by full((B, 1), 0), which reads the batch size
    flags = torch.cat([ok.long(), torch.full((ok.shape[0], 1), 0)], dim=1)
    return (flags == 0).int().argmax(1)


OK = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1], [0, 0, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("fn", [index_false, index_false_int], ids=lambda f: f.__name__)
def test_cat_along_columns_is_proven(fn):
    gm = aten_graph(fn, torch.ones(6, 4, dtype=torch.bool))
    assert not isinstance(_flag(gm).meta["val"].shape[0], int)  # the batch is symbolic
    assert any(n.target is torch.ops.aten.cat.default for n in gm.graph.nodes)
    assert prefix.prove_prefix_counts(gm.graph) >= 1
    gm.recompile()
    assert not any(n.target is torch.ops.aten.cat.default for n in gm.graph.nodes)
    got = run_graph(gm, ~OK)
    assert torch.equal(got, fn(OK)) and torch.equal(got.long(), _count(OK))


@pytest.mark.parametrize("batch", ["symbolic", "static"])
def test_cat_with_full_column(batch):
    """full((B, 1), 0) reads the batch size: a SymInt input under a dynamic batch, which the
    proof binds to the rows it evaluates (the real graph's B is ok's batch); a constant when
    B is baked into the graph."""
    from torch.fx.experimental.proxy_tensor import make_fx
    if batch == "symbolic":
        gm = aten_graph(index_false_full, torch.ones(6, 4, dtype=torch.bool))
        assert not isinstance(_flag(gm).meta["val"].shape[0], int)
    else:
        gm = make_fx(lambda x: index_false_full(~x), tracing_mode="fake")(~OK)
    assert prefix.prove_prefix_counts(gm.graph) >= 1
    gm.recompile()
    assert not _nodes(gm, torch.ops.aten.cat.default)
    got = run_graph(gm, ~OK) if batch == "symbolic" else gm(~OK)
    assert torch.equal(got, index_false_full(OK))


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def test_cat_along_rows_is_refused():
    """Row b of cat([ok, ok], 0) is not row b of ok: row_local says no, the cat stays."""
    def rows_cat(ok):
        return torch.cat([ok, ok], dim=0).int().cumprod(1).sum(1).view(2, -1)[1]

    gm = aten_graph(rows_cat, torch.ones(6, 4, dtype=torch.bool))
    ok = _flag(gm)
    cat = _nodes(gm, torch.ops.aten.cat.default)[0]
    assert not rowlocal.row_local([cat], ok, cat)
    prefix.prove_prefix_counts(gm.graph)  # the count of the [2B, K] cat itself may be
    gm.recompile()                          # proven (it is a flag too); not one of `ok`
    assert _nodes(gm, torch.ops.aten.cat.default)
    assert torch.equal(run_graph(gm, ~OK), rows_cat(OK))


def test_columns_cat_is_local_on_its_own():
    gm = aten_graph(index_false, torch.ones(6, 4, dtype=torch.bool))
    ok, cat = _flag(gm), _nodes(gm, torch.ops.aten.cat.default)[0]
    order = [n for n in gm.graph.nodes if n.op == "call_function" and n is not ok
             and n.target is not torch.ops.aten.bitwise_not.default
             and list(gm.graph.nodes).index(n) <= list(gm.graph.nodes).index(cat)]
    assert rowlocal.row_local(order, ok, cat)


def test_row_varying_column_is_refused():
    """A column that is False only in the row where the all-masks batch puts the all-True
    mask: every mask evaluates to its prefix length, yet a real batch whose first row is all
    True gets 0 (no False to find). The column varies by row, so the cat is not local."""
    def alt_column(ok):  # B = 4 static, K = 2: the batch of all masks is one chunk
        col = (torch.arange(4) < 3)[:, None]
        return torch.eq(torch.cat([ok, col], dim=1), False).int().argmax(dim=1)

    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(lambda x: alt_column(~x), tracing_mode="fake")(torch.ones(4, 2, dtype=torch.bool))
    masks = prefix._all_masks(2)
    assert torch.equal(alt_column(masks).long(), _count(masks))  # the evaluation would agree
    assert prefix.prove_prefix_counts(gm.graph) == 0
    gm.recompile()
    real = torch.tensor([[1, 1], [0, 1], [1, 0], [0, 0]], dtype=torch.bool)
    assert torch.equal(gm(~real), alt_column(real))
    assert not torch.equal(alt_column(real).long(), _count(real))


def greedy_index_false(drafts, target_logits):
    target = target_logits.argmax(-1)
    ok = drafts == target[:, :-1]
    return index_false(ok), target


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_index_false_count_fuses(lowering, no_fx_cache):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 5, 13, generator=g)
    drafts = logits.argmax(-1)[:, :4].clone()
    drafts[0, 1] += 1
    drafts[2, 0] += 1
    drafts[3, 3] += 1
    three_way(greedy_index_false, (drafts, logits), lowering=lowering, matched=1,
              family="greedy_accept", appear=("npuspec.greedy_accept",), gone=("cat",))
