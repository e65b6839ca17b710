"""A batch of 1 through torch.compile(backend="npuspec"): one Dynamo graph for every batch size.

`mark_token_dim` makes the token dims unbacked, so Dynamo does not specialise size 1: the
graph traced at any first size also serves B=1 (no second compile, no second graph set), and
the dispatcher replays its 1-unit graph for a batch of 1 instead of padding it to 2 rows.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import npuspec.kernels  # noqa: F401  (registers torch.ops.npuspec.rejection_sample)
from npuspec.graphs import GraphSet, live_dispatchers, mark_token_dim
from npuspec.kernels import rejection_sample

K, V, HID, S, M = 3, 17, 8, 6, 8  # drafts, vocab, hidden, cache slots (last: scratch), positions
SCRATCH = S - 1
ORDERS = [(3, 1, 2, 1), (1, 3, 2, 1)]


class ToyStep(nn.Module):
    """Model-like step: embed [B, K+1] tokens, write them into a slot cache buffer in place,
    attend over the slot (broadcast mask), verify; also bumps a per-row input in place."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        w = lambda *shape: nn.Parameter(torch.randn(*shape, generator=g), requires_grad=False)  # noqa: E731
        self.emb, self.out = w(V, HID), w(HID, V)
        self.bias = w(V)  # [V] broadcast against [B, T, V]
        self.register_buffer("cache", torch.zeros(S, M, HID))

    def forward(self, input_ids, positions, slots, lens, draft_ids, temperature, uniforms,
                exponentials):
        x = self.emb[input_ids]                                   # [B, T, HID]
        self.cache[slots[:, None], positions] = x                 # in-place state write
        kv = self.cache[slots]                                    # [B, M, HID]
        visible = torch.arange(M)[None, None, :] <= positions[:, :, None]  # [1,1,M] vs [B,T,1]
        h = F.scaled_dot_product_attention(x[:, None], kv[:, None], kv[:, None],
                                           attn_mask=visible[:, None])[:, 0]
        logits = (h + x) @ self.out + self.bias
        tok, num = rejection_sample(logits, draft_ids, temperature=temperature,
                                    uniforms=uniforms, exponentials=exponentials)
        lens.add_(num.to(lens.dtype))                             # in-place update of an input
        return torch.cat([tok, num[:, None]], dim=1)


def toy_inputs(B: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, M - K - 1, (B,), generator=g)
    drafts = torch.randint(-1, V, (B, K), generator=g)
    temp = torch.rand(B, generator=g) * (torch.rand(B, generator=g) < 0.5)
    return {"input_ids": torch.randint(0, V, (B, K + 1), generator=g),
            "positions": start[:, None] + torch.arange(K + 1),
            "slots": torch.randperm(S - 1, generator=g)[:B],
            "lens": start + 10,
            "draft_ids": drafts,
            "temperature": temp,
            "uniforms": torch.rand(B, K, generator=g, dtype=torch.float64).float(),
            "exponentials": torch.empty(B, V).exponential_(generator=g)}


def mark_all(inp: dict, pads: dict) -> None:
    for name, t in inp.items():
        mark_token_dim(t, 0, pad=pads.get(name, 0))


@pytest.fixture
def picks(monkeypatch):
    """(units of the step, units of the graph replayed) for every dispatched step."""
    seen = []
    pick = GraphSet.pick

    def spy(self, u):
        got = pick(self, u)
        seen.append((u, got))
        return got

    monkeypatch.setattr(GraphSet, "pick", spy)
    return seen


def _compile(fn, lowering="eager"):
    opts = {"lowering": lowering, "max_num_seqs": 4,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": K}}
    return torch.compile(fn, backend="npuspec", options=opts)


def _run_orders(order, compiled_step, ref_step, make, pads, delta, picks, state, exact=True):
    """Run `order` through the compiled and an eager twin; check outputs, state, one graph."""
    stats = torch._dynamo.utils.counters["stats"]
    g0, before = stats["unique_graphs"], {id(d) for d in live_dispatchers()}
    f = _compile(compiled_step)
    for i, B in enumerate(order):
        inp = make(B, i)
        ref_inp = {k: v.clone() for k, v in inp.items()}
        want = ref_step(**ref_inp)
        mark_all(inp, pads)
        got = f(**inp)
        assert torch.equal(got, want), (B, got, want)
        for k in inp:  # in-place updated inputs come back as eager's
            assert torch.equal(inp[k], ref_inp[k]), (B, k)
        for a, b in state():  # in-place updated buffers (real slots; the scratch one differs)
            assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-5), B
    assert stats["unique_graphs"] - g0 == 1  # one Dynamo graph for B = 3, 1, 2, 1 (or 1 first)
    disps = [d for d in live_dispatchers() if id(d) not in before]
    assert len(disps) == 1 and len(disps[0].sets) == 1
    (gs,) = disps[0].sets.values()
    assert gs.sizes == [1, 2, 4] and sorted(gs.entries) == [1, 2, 4]  # 1 request captured
    assert gs.captured_sizes == [4, 8, 16]
    assert picks == [(B, {1: 1, 2: 2, 3: 4}[B]) for B in order]  # B=1 replays the 1-unit graph
    d = delta()
    assert d["graphs_captured"] == 3 and d["graph_replays"] == len(order)
    assert "eager_fallbacks" not in d
    return gs


@pytest.mark.parametrize("order", ORDERS, ids=["3121", "1321"])
def test_one_graph_serves_batch_one(order, fresh_dynamo, delta, picks):
    step = ToyStep()
    ref = copy.deepcopy(step)
    pads = {"slots": SCRATCH, "draft_ids": -1}
    gs = _run_orders(order, step, ref, toy_inputs, pads, delta, picks,
                     lambda: [(step.cache[:SCRATCH], ref.cache[:SCRATCH])])
    kinds = {s.kind for s in gs.slots}
    assert "token" in kinds and "static" in kinds  # rows padded; the cache passed by address
    assert any(s.mutated for s in gs.slots)        # `lens` is written back row by row


def test_guards_have_no_size_one_specialisation(fresh_dynamo):
    """The graph's shape guards: equal batch sizes (one shape id) and size >= 0, no `>= 2`."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    step = ToyStep()

    def run(**kw):
        return step(**kw)

    f = _compile(run)
    inp = toy_inputs(1, 0)
    mark_all(inp, {"slots": SCRATCH, "draft_ids": -1})
    f(**inp)
    (entry,) = _debug_get_cache_entry_list(run.__code__)
    sizes = [ln.split("#")[0] for ln in str(entry.guard_manager).splitlines() if ".size()[0]" in ln]
    assert not any(s in ln for ln in sizes for s in ("2 <=", "== 1", "!= 1"))  # no 0/1 rule
    assert any("['slots'].size()[0] == " in ln and "['input_ids'].size()[0]" in ln for ln in sizes)
    assert any("0 <= " in ln for ln in sizes)
    for B in (2, 4, 1):  # the same entry serves every size
        inp = toy_inputs(B, B)
        mark_all(inp, {"slots": SCRATCH, "draft_ids": -1})
        f(**inp)
    assert len(_debug_get_cache_entry_list(run.__code__)) == 1


def test_inductor_size_one_matches_eager(fresh_dynamo, delta, picks):
    """Inductor's code for the unbacked batch dim is right at size 1 (broadcasts included)."""
    step = ToyStep()
    ref = copy.deepcopy(step)
    _run_orders((1, 3, 1), step, ref, toy_inputs, {"slots": SCRATCH, "draft_ids": -1}, delta,
                picks, lambda: [(step.cache[:SCRATCH], ref.cache[:SCRATCH])], exact=False)


# -- the engine's call pattern ------------------------------------------------------------------
ENGINE_PAD = {"draft_ids": -1, "top_p": 1.0, "uniforms": 1.0, "exponentials": 1.0}


class DecoderStep(nn.Module):
    """The engine's VerifyStep (over the slot cache), copied: decoder forward + verify op."""

    def __init__(self, model, cache):
        super().__init__()
        self.model = model
        self.register_buffer("k_cache", cache.pool.k, persistent=False)
        self.register_buffer("v_cache", cache.pool.v, persistent=False)
        self.geometry = (cache.pool.block_size, cache.num_slots, cache.max_len)

    def forward(self, input_ids, positions, slots, draft_ids, temperature=None, uniforms=None,
                exponentials=None):
        logits = self.model(input_ids, positions, slots, self.slot_cache())
        out, num = torch.ops.npuspec.rejection_sample(
            logits, draft_ids, None, temperature, None, None, uniforms, exponentials,
            False, None, None, None)
        return torch.cat([out, num[:, None]], dim=1)

    def slot_cache(self):
        from npuspec.models.decoder import KVCache, PagedKVCache
        bs, num_slots, max_len = self.geometry
        return KVCache(PagedKVCache(self.k_cache, self.v_cache, bs), num_slots, max_len)


def _decoder(cache_slots, cache_len):
    from npuspec.models.config import ModelConfig
    from npuspec.models.decoder import DecoderLM
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=4, intermediate_size=24, tie_word_embeddings=True)
    model = DecoderLM(cfg).eval()
    return model, model.allocate_cache(cache_slots, cache_len)


@pytest.mark.parametrize("order", ORDERS, ids=["3121", "1321"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_engine_call_pattern(order, sampled, fresh_dynamo, delta, picks):
    """The engine's run_step, copied: inference mode, every per-request input marked at dim 0
    (pad: scratch slot, -1 drafts, 1.0 draws), one compiled step per variant."""
    max_num_seqs = 4
    model, cache = _decoder(max_num_seqs + 1, M + K + 1)
    step = DecoderStep(model, cache)
    ref = DecoderStep(copy.deepcopy(model), copy.deepcopy(cache))

    def make(B, seed):
        inp = toy_inputs(B, seed)
        inp = {k: inp[k] for k in ("input_ids", "positions", "slots", "draft_ids")}
        if sampled:
            t = toy_inputs(B, seed + 100)
            inp.update(temperature=t["temperature"] + 0.5, uniforms=t["uniforms"],
                       exponentials=t["exponentials"])
        return inp

    def call(fn):
        @torch.inference_mode()
        def run(**kw):
            return fn(**kw)
        return run

    pads = dict(ENGINE_PAD, slots=max_num_seqs)
    with torch.inference_mode():
        _run_orders(order, step, call(ref), make, pads, delta, picks,
                    lambda: [(getattr(step.slot_cache(), kv)[:, :max_num_seqs],
                              getattr(ref.slot_cache(), kv)[:, :max_num_seqs]) for kv in "kv"])


def test_group_none_keeps_the_backed_marking(fresh_dynamo, delta):
    """mark_token_dim(group=None): the old backed marking, so a batch of 1 is Dynamo's own
    (static) graph, captured once at its exact shape."""
    stats = torch._dynamo.utils.counters["stats"]
    g0 = stats["unique_graphs"]
    f = _compile(lambda x: x * 2 + 1)
    for B in (3, 1, 2):
        x = mark_token_dim(torch.randn(B, 4), group=None)
        assert torch.equal(f(x), x * 2 + 1)
    assert stats["unique_graphs"] - g0 == 2


def test_flat_tokens_in_their_own_group(fresh_dynamo, delta, picks):
    """Flat tokens [B*(K+1)] next to per-request rows [B]: two groups, one graph, B=1 too."""
    emb = torch.randn(40, V, generator=torch.Generator().manual_seed(5))

    def flat(tokens, drafts):
        B, k = drafts.shape
        logits = emb[tokens].view(B, k + 1, V)
        return rejection_sample(logits, drafts)

    stats = torch._dynamo.utils.counters["stats"]
    g0 = stats["unique_graphs"]
    f = _compile(flat)
    gen = torch.Generator().manual_seed(6)
    for B in (1, 3, 1, 2):
        tokens = mark_token_dim(torch.randint(0, 40, (B * (K + 1),), generator=gen), group="tokens")
        drafts = mark_token_dim(torch.randint(-1, V, (B, K), generator=gen))
        got, want = f(tokens, drafts), flat(tokens, drafts)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), B
    assert stats["unique_graphs"] - g0 == 1
    assert [p for _, p in picks] == [1, 4, 1, 2]


@pytest.mark.parametrize("lowering", ["eager", "inductor"])
def test_unmarked_user_step_first_call_one_request(fresh_dynamo, lowering):
    """Issue 13, point 2: a plain user step (no marks, default backend options) whose first
    call has B=1, then larger batches, then B=1 again, replays with eager's results (it used
    to die on "output dim 0 of size 1 is not a multiple of 4 units")."""
    from npuspec import counters

    w = torch.randn(HID, V, generator=torch.Generator().manual_seed(9))

    def step(hidden, drafts):
        return rejection_sample((hidden @ w).view(-1, K + 1, V), drafts)

    f = torch.compile(step, backend="npuspec", options={"lowering": lowering})
    gen = torch.Generator().manual_seed(10)
    replays, fallbacks = counters["graph_replays"], counters["eager_fallbacks"]
    for B in (1, 2, 16, 3, 1):
        h = torch.randn(B * (K + 1), HID, generator=gen)
        d = torch.randint(-1, V, (B, K), generator=gen)
        got, want = f(h, d), step(h, d)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), B
    # B=1 is Dynamo's own static graph (unmarked: its 0/1 rule), which has nothing to pad, so
    # on CPU it is called directly; B = 2, 16, 3 replay the dynamic graph's captured sizes
    assert counters["graph_replays"] - replays == 3
    assert counters["eager_fallbacks"] == fallbacks
