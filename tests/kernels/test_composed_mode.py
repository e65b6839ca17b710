"""rejection_sample's composed mode (bonus_token_ids given; kernels/verify_composed.py): the op
equals `composed_verify_ref` (the narrow ops' references on every row, then the emission) bit
for bit, over every residual configuration, padded slots (q = inf in the test's q, as vLLM v1
writes it), zero and infinite draws, both bonus shapes and K = 0; and its errors name the value.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from npuspec.kernels import rejection_sample
from npuspec.kernels.accept import NONNEG, NORMALIZE, SAMPLERS
from npuspec.kernels.verify_composed import composed_verify_ref

B, K, V = 6, 4, 37


def _case(seed: int, e_rows: int = K, bonus_2d: bool = True):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 2, -1)
    ids = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    ids[1, :2] = p[1, :2].argmax(-1)                     # likely accepted
    u = torch.rand(B, K, generator=g)
    u[2, 0] = 0.0                                         # u = 0 accepts even p/inf = 0
    e = torch.empty(B, e_rows, V).exponential_(generator=g)
    e[3, 0, 5] = 0.0                                      # a zero draw: r / 0 = inf (or NaN)
    e[4, 0, 7] = float("inf")
    q[0, 1, ids[0, 1]] = 0.0                              # p/0 = inf: accepted
    qa = q.clone()
    pad = torch.zeros(B, K, dtype=torch.bool)
    pad[5, 2:] = True                                     # vLLM v1's padding: ids 0, q inf
    ids[pad] = 0
    qa[pad] = float("inf")
    bonus = torch.randint(0, V, (B, 1) if bonus_2d else (B,), generator=g)
    return p, ids, q, qa, u, e, bonus


CONFIGS = [(nz, s, nn, fl, gd, fi)
           for nz, s, nn in itertools.product(NORMALIZE, SAMPLERS, NONNEG)
           for fl in ((0.0, 1e-5) if nn == "clamp" else (0.0,))
           for gd, fi in (("none", 0.0), ("zero_inf", -1e10)) if gd == "none" or s == "race"]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_op_equals_reference(cfg):
    nz, s, nn, fl, gd, fi = cfg
    for seed in range(3):
        p, ids, q, qa, u, e, bonus = _case(seed, e_rows=K if seed else 1, bonus_2d=seed != 2)
        kw = dict(residual_normalize=nz, residual_sampler=s, residual_nonneg=nn,
                  residual_floor=fl, residual_guard=gd, residual_fill=fi)
        got = rejection_sample(p, ids, q, target_is_probs=True, uniforms=u, exponentials=e,
                               bonus_token_ids=bonus, accept_draft_probs=qa, **kw)
        want = composed_verify_ref(p, ids, q, u, e, bonus, qa, "ge", **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (seed, got, want)


def test_shapes_modes_and_rows():
    """p without its bonus row, accept modes, an all-accepted row emitting the bonus, K = 0."""
    p, ids, q, qa, u, e, bonus = _case(7)
    for mode in ("ge", "gt", "not_lt", "not_le"):
        got = rejection_sample(p[:, :K], ids, q, target_is_probs=True, uniforms=u,
                               exponentials=e, bonus_token_ids=bonus, accept_mode=mode)
        want = composed_verify_ref(p, ids, q, u, e, bonus, None, mode)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), mode
    u0 = torch.zeros(B, K)                                  # every draft accepted
    out, num = rejection_sample(p, ids, q, target_is_probs=True, uniforms=u0, exponentials=e,
                                bonus_token_ids=bonus)
    assert torch.equal(num, torch.full((B,), K + 1, dtype=torch.int32))
    assert torch.equal(out[:, :K], ids.int()) and torch.equal(out[:, K], bonus[:, 0].int())
    out, num = rejection_sample(p[:, :0], ids[:, :0], q[:, :0], target_is_probs=True,
                                uniforms=u[:, :0], exponentials=e[:, :0], bonus_token_ids=bonus)
    assert torch.equal(out, bonus.int()) and torch.equal(num, torch.ones(B, dtype=torch.int32))


def test_draws_made_when_not_given():
    p, ids, q, _, _, _, bonus = _case(3)
    torch.manual_seed(5)
    a = rejection_sample(p, ids, q, target_is_probs=True, bonus_token_ids=bonus)
    torch.manual_seed(5)
    b = rejection_sample(p, ids, q, target_is_probs=True, bonus_token_ids=bonus)
    assert torch.equal(a[0], b[0]) and ((a[0] >= -1) & (a[0] < V)).all()


def test_compiles_as_one_op():
    p, ids, q, qa, u, e, bonus = _case(1)

    def step(p, ids, q, qa, u, e, bonus):
        return rejection_sample(p, ids, q, target_is_probs=True, uniforms=u, exponentials=e,
                                bonus_token_ids=bonus, accept_draft_probs=qa,
                                residual_normalize="row", residual_floor=1e-5)
    torch._dynamo.reset()
    got = torch.compile(step, backend="eager", fullgraph=True)(p, ids, q, qa, u, e, bonus)
    want = step(p, ids, q, qa, u, e, bonus)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("change,match", [
    (dict(target_is_probs=False), "target_is_probs=True"),
    (dict(ratio_cap=True), "ratio_cap=True"),
    (dict(draft_probs=None), "without draft_probs"),
    (dict(temperature=torch.ones(B)), "temperature given with bonus_token_ids"),
    (dict(block_verify=True), "block_verify=True with bonus_token_ids"),
    (dict(bonus_token_ids=torch.zeros(B, 2, dtype=torch.long)), "bonus_token_ids: expected"),
    (dict(exponentials=torch.ones(B, V)), "exponentials: expected a tensor that broadcasts"),
    (dict(residual_sampler="softmax"), "residual_sampler='softmax'"),
    (dict(residual_floor=1e-5, residual_nonneg="where"), "floor=1e-05 needs nonneg='clamp'"),
])
def test_errors_name_the_value(change, match):
    p, ids, q, qa, u, e, bonus = _case(0)
    kw = dict(draft_probs=q, target_is_probs=True, uniforms=u, exponentials=e,
              bonus_token_ids=bonus)
    kw.update(change)
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("[", r"\[")):
        rejection_sample(p, ids, **kw)


def test_composed_keywords_need_bonus():
    p, ids, q, qa, u, e, _ = _case(0)
    with pytest.raises(ValueError, match="belong to the composed mode"):
        rejection_sample(p, ids, q, target_is_probs=True, uniforms=u, exponentials=e[:, 0],
                         residual_floor=1e-5)
    with pytest.raises(TypeError, match="unknown keyword"):
        rejection_sample(p, ids, q, target_is_probs=True, residual_flor=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_row_normalised_residual_on_row_n_only_keeps_the_sums(threads):
    """normalize="row" builds and sums only row n (kernels/verify_composed._row_sums): the
    bits equal the full [B, K, V] residual's sums at every thread count, with rows long enough
    (V > 32768) that PyTorch would split a lone row across threads; B = 1 and K = 1 too."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b, k in ((1, 1), (1, 3), (2, 1), (3, 4)):
            g = torch.Generator().manual_seed(b * 10 + k)
            v = 40_000
            p = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 3, -1)
            q = torch.softmax(torch.randn(b, k, v, generator=g) * 3, -1)
            ids = torch.randint(0, v, (b, k), generator=g)
            u = torch.rand(b, k, generator=g) * 1e-3          # rejections somewhere
            e = torch.empty(b, k, v).exponential_(generator=g)
            bonus = torch.randint(0, v, (b,), generator=g)
            kw = dict(residual_normalize="row", residual_floor=1e-5)
            got = rejection_sample(p, ids, q, target_is_probs=True, uniforms=u,
                                   exponentials=e, bonus_token_ids=bonus, **kw)
            want = composed_verify_ref(p, ids, q, u, e, bonus, None, "ge", **kw)
            assert torch.equal(got[0], want[0]), (threads, b, k)
            # and the sums themselves, not only the tokens they lead to
            from npuspec.kernels.verify_composed import _row_sums
            r = torch.clamp(p[:, :k] - q, min=1e-5)                 # [b, k, v]
            full = r.sum(-1, keepdim=True)
            for i in range(b):
                for j in range(k):
                    one = _row_sums(r[i, j][None].contiguous(), b * k)
                    bits = one.view(-1).view(torch.int32)
                    assert torch.equal(bits, full[i, j].view(torch.int32)), (threads, b, k, i, j)
    finally:
        torch.set_num_threads(old)


def test_row_n_picks_the_rows_advanced_indexing_picks():
    """_row_n's index_select over every row a tensor spans, its views and its fallback: the
    values of `broadcast_to(t, [B, K, V])[b, n]` in every layout the op meets."""
    from npuspec.kernels.verify_composed import _row_n
    g = torch.Generator().manual_seed(0)
    for Bn in (1, B):
        b = torch.arange(Bn)
        nk = torch.randint(0, K, (Bn,), generator=g)
        full = torch.randn(Bn, K + 1, V, generator=g)
        big = torch.randn(Bn + 1, K + 2, V, generator=g)
        layouts = {
            "contiguous": full[:, :K].contiguous(),
            "sliced [:, :K]": full[:, :K],
            "sliced [:, 1:]": full[:, 1:],
            "inside a larger tensor, at its end": big[1:, 2:],
            "one row per request": full[:, :1],
            "[K, V] (broadcast over requests)": full[0, :K].contiguous(),
            "[V]": full[0, 0].contiguous(),
            "expanded over K": full[:, :1].expand(Bn, K, V),
            "V not innermost": full[:, :K].transpose(0, 1).contiguous().transpose(0, 1),
            "columns strided": torch.randn(Bn, K, 2 * V, generator=g)[..., ::2],
        }
        for name, t in layouts.items():
            want = torch.broadcast_to(t, (Bn, K, V))[b, nk]
            got = _row_n(t, b, nk, K, V)
            assert torch.equal(got, want), (Bn, name)
