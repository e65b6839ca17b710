"""The chain drafters' (EAGLE-3, EAGLE, MTP) and Medusa's training forward and loss.

Their serving forward is paged (a KV pool and `paged_attention`, which has no autograd), so
`dense_chain` / `dense_medusa` run the same submodules densely and differentiably; tests check
they equal the paged forward. A sequence of N tokens x_0..x_{N-1} with target features f_j and
target logits z_j gives N-1 rows; at TTT / chain step s, row j reads token x_{j+1+s} at position
j+s and is trained towards softmax(z_{j+1+s}), the target's distribution of x_{j+2+s}. Step 0
reads the target feature f_j; step s > 0 reads the draft's own hidden of step s-1 at the same
row. Attention at step s ("TTT pattern"): the step-0 keys of rows <= j, plus the keys of steps
1..s of row j itself; this is exactly what the paged chain sees in serving (the first pass's K/V
at positions 0..j, then its own K/V at j+1..j+s).

Losses (`ChainObjective`), soft cross-entropies against the target's own distributions:
    eagle3  sum_s 0.8^s CE_s over `ttt_steps` steps, in the draft vocabulary (Vd < V: the
            top-Vd training tokens; the target's distribution renormalized over them, rows
            whose target argmax is outside masked out)
    eagle   sum_s 0.8^s [smooth_l1(h_s, f_{j+1+s}) + 0.1 CE_s(target_head(h_s))] (EAGLE-1's
            feature regression; f = the target's post-norm final hidden); ttt_steps=1 default
    mtp     sum_s 0.8^s CE_s (step 0: x_{j+1} with the target's post-norm h_j; steps > 0
            recycle the MTP's own post-norm output, for K > 1 reuse); ttt_steps=1 default
    medusa  sum_k 0.8^k CE(head k at row j, softmax(z_{j+1+k})) (head k drafts x_{j+2+k})
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from npuspec.models.decoder import _linear
from npuspec.train.config import TrainConfig
from npuspec.train.data import Batch

CLS_WEIGHT = 0.1   # EAGLE-1: weight of the classification loss next to the feature regression


def _shift(x: torch.Tensor, k: int, rows: int) -> torch.Tensor:
    """x[:, k:k+rows] zero-padded on the right to `rows` (dim 1)."""
    out = x[:, k:k + rows]
    pad = rows - out.shape[1]
    if pad > 0:
        shape = list(out.shape)
        shape[1] = pad
        out = torch.cat([out, out.new_zeros(shape)], dim=1)
    return out



def target_head_weight(target) -> torch.Tensor:
    if getattr(target, "head_packed", None) is not None:
        raise ValueError("train-draft needs an unpacked target (load it with load_model)")
    return target.embed.weight if target.lm_head is None else target.lm_head.weight


def ttt_attention(q: torch.Tensor, ks: list, vs: list) -> torch.Tensor:
    """q [B, T, Hq, D]; ks[0]/vs[0] [B, T, Hkv, D] the step-0 keys (seen causally), ks[i>0] the
    keys of later steps (each row sees only its own) -> [B, T, Hq*D]."""
    B, T, Hq, D = q.shape
    Hkv = ks[0].shape[2]
    G = Hq // Hkv
    qg = q.float().reshape(B, T, Hkv, G, D)
    scale = D ** -0.5
    s0 = torch.einsum("bqhgd,bkhd->bhgqk", qg, ks[0].float()) * scale     # [B, Hkv, G, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [torch.einsum("bqhgd,bqhd->bhgq", qg, k.float())[..., None] * scale for k in ks[1:]]
    p = torch.softmax(torch.cat([s0] + diag, dim=-1), dim=-1)
    o = torch.einsum("bhgqk,bkhd->bqhgd", p[..., :T], vs[0].float())
    for i, v in enumerate(vs[1:]):
        w = p[..., T + i].permute(0, 3, 1, 2)[..., None]                  # [B, T, Hkv, G, 1]
        o = o + w * v.float()[:, :, :, None, :]
    return o.reshape(B, T, Hq * D).to(q.dtype)


class _TTTKV:
    """Per draft layer, the K/V of each step so far; `attend(i)` is DraftLayer's callback."""

    def __init__(self, n_layers: int):
        self.k = [[] for _ in range(n_layers)]
        self.v = [[] for _ in range(n_layers)]

    def attend(self, i: int):
        def fn(q, k, v):
            self.k[i].append(k)
            self.v[i].append(v)
            return ttt_attention(q, self.k[i], self.v[i])
        return fn


def _rope(module, positions, dtype):
    freqs = positions[..., None].float() * module.inv_freq                # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _embed(module, ids, dtype, own):
    if own is not None:
        return own(ids)
    return module._target.embed_tokens(ids).to(dtype)


def _step_eagle3(m, ids, hidden, positions, cos, sin, attend):
    e = _embed(m, ids, hidden.dtype, m.embed_tokens)
    l0 = m.layers[0]
    hn = l0.hidden_norm(hidden)
    residual = hn if m.config.norm_before_residual else hidden
    x = torch.cat([l0.input_layernorm(e), hn], dim=-1)                    # embedding first
    h = l0(x, residual, cos, sin, attend(0))
    for i in range(1, len(m.layers)):
        layer = m.layers[i]
        h = layer(layer.input_layernorm(h), h, cos, sin, attend(i))
    return m.norm(h), h


def _step_eagle(m, ids, hidden, positions, cos, sin, attend):
    e = _embed(m, ids, hidden.dtype, m.embed_tokens)
    if m.config.para_norm:
        e, hidden = m.embedding_layernorm(e), m.hidden_states_layernorm(hidden)
    h = _linear(torch.cat([e, hidden], dim=-1), m.fc)  # serving's call (packed or not)
    for i, layer in enumerate(m.layers):
        x = h if layer.input_layernorm is None else layer.input_layernorm(h)
        h = layer(x, h, cos, sin, attend(i))
    return h, h


def _step_mtp(m, ids, hidden, positions, cos, sin, attend):
    layer = m.layers[0]
    e = _embed(m, ids, hidden.dtype, layer.embed_tokens)
    e = e.masked_fill((positions == 0)[..., None], 0.0)  # vLLM: nothing precedes position 0
    h0 = _linear(torch.cat([layer.enorm(e), layer.hnorm(hidden)], dim=-1), layer.eh_proj)
    h = layer(layer.input_layernorm(h0), h0, cos, sin, attend(0))
    out = layer.shared_head.norm(h)
    return out, out


_STEPS = {"eagle3": _step_eagle3, "eagle": _step_eagle, "mtp": _step_mtp}


def dense_chain(module, step_ids: Sequence[torch.Tensor], features: torch.Tensor,
                first_position: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The dense, differentiable forward of an EAGLE / EAGLE-3 / MTP draft over len(step_ids)
    TTT (chain) steps: step s reads step_ids[s] [B, T] at positions first_position + s + row,
    step 0 the target features [B, T, F] (through `first_hidden`), step s > 0 the hidden the
    step before returned. -> [(logit_h, next_h)] per step, what the module's paged `forward`
    returns for the same rows."""
    if module.method == "mtp" and len(module.layers) != 1:
        raise NotImplementedError("training MTP with more than one next-n layer")
    step = _STEPS[module.method]
    B, T = step_ids[0].shape
    kv = _TTTKV(len(module.layers))
    hidden = module.first_hidden(features)
    out = []
    for s, ids in enumerate(step_ids):
        positions = (torch.arange(T, device=ids.device) + first_position + s).expand(B, T)
        cos, sin = _rope(module, positions, hidden.dtype)
        logit_h, hidden = step(module, ids, hidden, positions, cos, sin, kv.attend)
        out.append((logit_h, hidden))
    return out


def dense_medusa(module, h: torch.Tensor) -> list[torch.Tensor]:
    """Medusa head k's hidden (before its LM head) for the target hidden h [.., H]."""
    return [block(h) for block in module.blocks]



def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over mask of -sum p log q, p = softmax(target_logits), q = softmax(logits)."""
    p = torch.softmax(target_logits.float(), dim=-1)
    ce = -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
    m = mask.float()
    return (ce * m).sum() / m.sum().clamp_min(1.0)


class ChainObjective:
    """Loss and teacher-forced predictions of one method over a Batch."""

    def __init__(self, module, target, cfg: TrainConfig):
        self.m, self.target, self.cfg = module, target, cfg
        self.W = target_head_weight(target)  # frozen
        self.method = module.method
        if self.method == "eagle3":
            d2t = module.d2t
            self.used = torch.arange(d2t.numel()) + d2t
            self.full = d2t.numel() == target.config.vocab_size and not bool(d2t.any())
            self.t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
            self.t2d[self.used] = True

    def _step_targets(self, b: Batch, s: int):
        R = b.rows
        return _shift(b.logits, 1 + s, R), _shift(b.mask, 1 + s, R)

    def _chain(self, b: Batch, steps: int):
        R = b.rows
        ids = [_shift(b.ids, 1 + s, R) for s in range(steps)]
        feats = (b.aux if self.method == "eagle3" else b.final)[:, :R]
        return dense_chain(self.m, ids, feats)

    def _draft_logits(self, logit_h):
        """Logits in the draft's own vocabulary (Vd for eagle3, else V)."""
        if self.method == "eagle3":
            return F.linear(logit_h, self.m.lm_head.weight)
        if self.method == "mtp" and self.m.layers[0].shared_head.head is not None:
            return F.linear(logit_h, self.m.layers[0].shared_head.head.weight)
        return F.linear(logit_h, self.W)

    def _to_target_ids(self, draft_ids):
        if self.method == "eagle3" and not self.full:
            return self.used[draft_ids]
        return draft_ids

    def loss(self, b: Batch):
        cfg, R = self.cfg, b.rows
        total, parts = 0.0, []
        if self.method == "medusa":
            hs = dense_medusa(self.m, b.final[:, :R])
            for k, h in enumerate(hs):
                tl, mk = self._step_targets(b, k)
                lk = soft_ce(F.linear(h, self.m.lm_heads[k].weight), tl, mk)
                total = total + cfg.decay ** k * lk
                parts.append(float(lk.detach()))
            return total, parts
        out = self._chain(b, cfg.ttt_steps)
        for s, (logit_h, next_h) in enumerate(out):
            tl, mk = self._step_targets(b, s)
            if self.method == "eagle3" and not self.full:
                mk = mk & self.t2d[tl.argmax(-1)]
                tl = tl[..., self.used]
            ls = soft_ce(self._draft_logits(logit_h), tl, mk)
            if self.method == "eagle":
                tf = _shift(b.final, 1 + s, R)
                reg = F.smooth_l1_loss(next_h, tf, reduction="none").mean(-1)
                m = mk.float()
                ls = (reg * m).sum() / m.sum().clamp_min(1.0) + CLS_WEIGHT * ls
            total = total + cfg.decay ** s * ls
            parts.append(float(ls.detach()))
        return total, parts

    @torch.no_grad()
    def agreement(self, b: Batch, K: int):
        """-> (hits [K], counts [K]): rows whose draft argmax equals the target's at position k."""
        R = b.rows
        if self.method == "medusa":
            hs = dense_medusa(self.m, b.final[:, :R])
            preds = [F.linear(h, self.m.lm_heads[k].weight).argmax(-1) for k, h in enumerate(hs)]
        else:
            preds = [self._to_target_ids(self._draft_logits(lh).argmax(-1))
                     for lh, _ in self._chain(b, K)]
        hits, counts = [], []
        for s, pred in enumerate(preds):
            tl, mk = self._step_targets(b, s)
            hits.append(int(((pred == tl.argmax(-1)) & mk).sum()))
            counts.append(int(mk.sum()))
        return hits, counts
