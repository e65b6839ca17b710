"""Small graphs after the passes, snapshotted (EXPECTTEST_ACCEPT=1 pytest ... to update)."""
import torch
from expecttest import TestCase

from npuspec.passes import PassManager
from passes_helpers import aten_graph, compact


def greedy_step(logits, drafts):
    target = logits.argmax(dim=-1)
    n = (drafts == target[:, :-1]).cumprod(dim=-1).sum(dim=-1)
    pos = torch.arange(target.shape[1])
    return torch.where(pos[None, :] <= n[:, None], target, -1), n


def hf_count(selected, cand):
    return ((~(cand == selected[:, :-1])).cumsum(dim=-1) < 1).sum()


def ratio_then_race(p, q, ids, u, e):
    px = p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    n = (u <= px / qx).cumprod(dim=1).sum(dim=1)
    r = torch.clamp(p[:, 0] - q[:, 0], min=0)
    return n, (r / r.sum(-1, keepdim=True) / e).argmax(-1)


def sampling_step(p, q, ids, u, e):
    K = ids.shape[1]
    px = p[:, :K].gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    n = (px / qx >= u).cumprod(dim=-1).sum(dim=-1)
    rec = (torch.clamp(p[:, :K] - q, min=0) / e[:, None, :]).argmax(dim=-1)
    bonus = (p[:, K] / e).argmax(dim=-1)
    return torch.cat([rec, bonus[:, None]], dim=1).gather(1, n[:, None]).squeeze(1), n


def _run(fn, *args):
    gm = aten_graph(fn, *args)
    PassManager().run(gm, flavor="aten")
    return compact(gm)


class TestSnapshots(TestCase):
    def test_greedy_step(self):
        self.assertExpectedInline(_run(greedy_step, torch.randn(2, 4, 9), torch.randint(0, 9, (2, 3))), """\
logits_1 = input
drafts_1 = input
rejection_sample_default = npuspec.rejection_sample(logits_1, drafts_1, None, None, None, None, None, None, False, None, None, None, checks=False)
getitem = getitem(rejection_sample_default, 0)
getitem_1 = getitem(rejection_sample_default, 1)
_to_copy_default = aten._to_copy(getitem, dtype=torch.int64)
_to_copy_default_1 = aten._to_copy(getitem_1, dtype=torch.int64)
sub_tensor = aten.sub(_to_copy_default_1, 1)
return (_to_copy_default, sub_tensor)""")

    def test_hf_assisted_count(self):
        self.assertExpectedInline(_run(hf_count, torch.randint(0, 9, (1, 4)), torch.randint(0, 9, (1, 3))), """\
selected_1 = input
cand_1 = input
slice_2 = aten.slice(selected_1, 1, 0, 3)
greedy_accept_default = npuspec.greedy_accept(cand_1, slice_2)
sum_default = aten.sum(greedy_accept_default)
return sum_default""")

    def test_ratio_then_race(self):
        p, q = torch.rand(2, 3, 9), torch.rand(2, 3, 9)
        self.assertExpectedInline(_run(ratio_then_race, p, q, torch.randint(0, 9, (2, 3)),
                                       torch.rand(2, 3), torch.rand(2, 9)), """\
p_1 = input
q_1 = input
ids_1 = input
u_1 = input
e_1 = input
ratio_accept_default = npuspec.ratio_accept(p_1, q_1, ids_1, u_1)
select_2 = aten.select(p_1, 1, 0)
select_3 = aten.select(q_1, 1, 0)
residual_sample_default = npuspec.residual_sample(select_2, select_3, e_1, row, race)
return (ratio_accept_default, residual_sample_default)""")

    def test_sampling_step(self):
        p, q = torch.rand(2, 4, 9), torch.rand(2, 3, 9)
        self.assertExpectedInline(_run(sampling_step, p, q, torch.randint(0, 9, (2, 3)),
                                       torch.rand(2, 3), torch.rand(2, 9)), """\
p_1 = input
q_1 = input
ids_1 = input
u_1 = input
e_1 = input
rejection_sample_default = npuspec.rejection_sample(p_1, ids_1, q_1, None, None, None, u_1, e_1, False, None, None, None, target_is_probs=True)
getitem = getitem(rejection_sample_default, 0)
getitem_1 = getitem(rejection_sample_default, 1)
_to_copy_default = aten._to_copy(getitem_1, dtype=torch.int64)
sub_tensor = aten.sub(_to_copy_default, 1)
_to_copy_default_1 = aten._to_copy(getitem, dtype=torch.int64)
unsqueeze_default = aten.unsqueeze(sub_tensor, 1)
gather_default = aten.gather(_to_copy_default_1, 1, unsqueeze_default)
squeeze_dim = aten.squeeze(gather_default, 1)
return (squeeze_dim, sub_tensor)""")

    def test_no_match_is_unchanged(self):
        def mlp(x, w):
            return torch.relu(x @ w).sum(-1)
        x, w = torch.randn(3, 4), torch.randn(4, 5)
        before = compact(aten_graph(mlp, x, w))
        self.assertEqual(_run(mlp, x, w), before)
