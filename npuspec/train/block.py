"""Training objective of the block drafters DFlash and DSpark (`npuspec.models.dflash`), used by
`npuspec.train.train` for `--method dflash|dspark` (facts: drafters.md §7, §8.3).

Serving (spec_decode/dflash_step.py) drafts one block per round: the context c = hidden_norm(fc(aux))
of positions 0..a-1 gives every draft layer's context K/V, and the block [x_a, MASK x (S-1)] at
positions a..a+S-1 attends non-causally to that context and to itself. Training does the same for
many random anchors a per sequence in one dense forward (`dense_block`): the blocks of all anchors
are one query sequence; block b's queries see context positions < a_b and its own S slots
(`block_attention`). Tests check it equals the paged serving path.

Both methods: draft k (k = 0..K-1) predicts the token at a+1+k, and the target's distribution of
that token is softmax(z_{a+k}) (z = the target's logits on the training window). DFlash's draft k
is slot k+1 (the anchor slot drafts nothing; K = S-1), DSpark's is slot k (K = S).

Losses (position weights w_k = exp(-k/gamma), weighted means over valid drafts):
    dflash  soft cross-entropy against softmax(z_{a+k}). Chosen over CE on the corpus tokens
            because serving accepts a draft when it equals the TARGET's token, and the corpus
            text is not the target's output; this matches the other methods (chain.py).
    dspark  (DeepSpec loss.py) 0.1 CE(gold x_{a+1+k}) + 0.9 ||p_draft - p_target||_1
            + 1.0 BCE(confidence logit, accept), accept = clamp(1 - ½||p_d - p_t||_1, 0, 1)
            detached; the Markov head is teacher-forced: prev_k = x_{a+k} (the anchor, then gold).

Held-out acceptance (`BlockObjective.evaluate`) is what serving does: per held-out anchor the
block is drafted greedily (DSpark walks its Markov head over its own drafts), the target verifies
[x_0..x_a, d_1..d_{K-1}] in one causal forward, and a_k = P(drafts 1..k all equal the target's
greedy tokens); the expected acceptance length is 1 + sum_k a_k (the bonus token included).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

BLOCK_METHODS = ("dflash", "dspark")
DSPARK_CE, DSPARK_L1, DSPARK_BCE = 0.1, 0.9, 1.0   # DeepSpec's ce/l1/confidence_head alphas
EVAL_SEED = 4321
VERIFY_ROWS = 32   # target verify forwards per call at eval (bounds the [rows, T, V] logits)


def sample_anchors(lengths: torch.Tensor, n: int, gen: torch.Generator, last: int):
    """n distinct anchors per row, uniformly among positions 1..lengths-1-last (a >= 1: serving
    always has a context before the anchor). -> anchors [B, n] int64 (sorted), keep [B, n]."""
    B = lengths.shape[0]
    T = int(lengths.max())
    pos = torch.arange(T)
    ok = (pos[None] >= 1) & (pos[None] <= lengths[:, None] - 1 - last)     # [B, T]
    r = torch.rand(B, T, generator=gen).masked_fill(~ok, 2.0)
    take = r.argsort(dim=1)[:, :n]
    if take.shape[1] < n:
        take = torch.cat([take, take.new_zeros(B, n - take.shape[1])], 1)
    keep = torch.arange(n)[None] < ok.sum(1, keepdim=True).clamp(max=n)
    anchors = torch.where(keep, take, torch.ones_like(take))  # a harmless anchor, masked out
    anchors, order = anchors.sort(dim=1)
    return anchors, keep.gather(1, order)


def block_attention(q, kc, vc, kb, vb, anchors, causal: bool = False):
    """The attention of the dense block forward. q [B, n*S, Hq, D] the blocks' queries, kc/vc
    [B, T, Hkv, D] the context K/V, kb/vb [B, n*S, Hkv, D] the blocks' own -> [B, n*S, Hq*D].
    The queries of block b (anchor a_b) see context positions < a_b and the S slots of block b
    (with `causal`, the slots up to their own, as dflash_config.causal serves it): one softmax
    over [context ; own block]. Scoring each block against its own S keys only, not all n*S,
    keeps this O(n*S*(T+S)) rather than O((n*S)^2)."""
    B, nS, Hq, D = q.shape
    T, Hkv = kc.shape[1], kc.shape[2]
    n = anchors.shape[1]
    S, G = nS // n, Hq // Hkv
    scale = D ** -0.5
    qg = q.float().reshape(B, n, S, Hkv, G, D)
    s_ctx = torch.einsum("bnshgd,bthd->bnhgst", qg, kc.float()) * scale   # [B, n, Hkv, G, S, T]
    ctx_ok = torch.arange(T)[None, None, :] < anchors[:, :, None]          # [B, n, T]
    s_ctx = s_ctx.masked_fill(~ctx_ok[:, :, None, None, None, :], float("-inf"))
    kbg = kb.float().reshape(B, n, S, Hkv, D)
    s_blk = torch.einsum("bnshgd,bnuhd->bnhgsu", qg, kbg) * scale          # [B, n, Hkv, G, S, S]
    if causal:
        s_blk = s_blk.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)           # every row sees its slot
    o = (torch.einsum("bnhgst,bthd->bnshgd", p[..., :T], vc.float())
         + torch.einsum("bnhgsu,bnuhd->bnshgd", p[..., T:], vb.float().reshape(B, n, S, Hkv, D)))
    return o.reshape(B, nS, Hq * D).to(q.dtype)


def block_ids(module, ids: torch.Tensor, anchors: torch.Tensor, S: int) -> torch.Tensor:
    """[x_a, MASK x (S-1)] per anchor -> [B, n, S]."""
    B, n = anchors.shape
    out = torch.full((B, n, S), module.config.mask_token_id, dtype=torch.long)
    out[:, :, 0] = ids.gather(1, anchors)
    return out


def dense_block(module, feats: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                S: Optional[int] = None) -> torch.Tensor:
    """The dense, differentiable block forward of a DFlash / DSpark draft: feats [B, T, F] the
    target's aux features of positions 0..T-1, ids [B, T], anchors [B, n] -> the post-norm
    hidden states [B, n, S, H] of every anchor's block, what the module's paged `forward`
    returns for that block after the context of positions < a was written."""
    m = module
    S = S or m.config.block_size
    B, T = ids.shape
    n = anchors.shape[1]
    cfg = m.config
    dt = m.norm.weight.dtype
    c = m.context(feats.to(dt))                                            # [B, T, H]
    cos_c, sin_c = m._rope(torch.arange(T).expand(B, T), dt)
    pos = (anchors[:, :, None] + torch.arange(S)).reshape(B, n * S)
    cos, sin = m._rope(pos, dt)
    h = m.embed_block(block_ids(m, ids, anchors, S).reshape(B, n * S), dt)
    for i, layer in enumerate(m.layers):
        kc, vc = m.context_kv(i, c, cos_c, sin_c)                          # [B, T, Hkv, D]

        def attend(q, k, v, kc=kc, vc=vc):
            return block_attention(q, kc, vc, k, v, anchors, cfg.draft_causal)

        h = layer(layer.input_layernorm(h), h, cos, sin, attend)
    return m.norm(h).view(B, n, S, -1)


def confidence_logit(module, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """DSpark's confidence before the sigmoid (BCE-with-logits is the stable form); the input is
    what `DSparkDraft.confidence` reads: [h; W1[prev]] or h."""
    x = h.float()
    mh = module.markov_head
    if mh is not None and module.config.confidence_with_markov:
        x = torch.cat([x, mh.markov_w1(prev).float()], dim=-1)
    p = module.confidence_head.proj
    return F.linear(x, p.weight.float(), p.bias.float())[..., 0]


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] at idx [B, n, K] (clamped into range) -> [B, n, K, ...]."""
    B, n, K = idx.shape
    flat = idx.clamp(0, x.shape[1] - 1).reshape(B, n * K)
    out = x[torch.arange(B)[:, None], flat]
    return out.view(B, n, K, *x.shape[2:])


class BlockObjective:
    """Loss and held-out acceptance of a DFlash / DSpark draft over `npuspec.train.data.Batch`es. Anchors
    are drawn from `gen` (the data generator, which the training state saves), so a resumed run
    draws the same ones."""

    def __init__(self, module, target, cfg, gen: torch.Generator):
        if module.vocab_index is not None:
            raise ValueError("training a block draft with a reduced draft vocabulary (d2t) is not "
                             "supported; build it with the target's vocabulary")
        self.m, self.target, self.cfg, self.gen = module, target, cfg, gen
        self.method = module.method
        self.S = module.config.block_size
        self.K = module.drafts_per_block
        self.off = self.S - self.K                  # the slot of draft 0 (1 for DFlash)
        self.w = torch.exp(-torch.arange(self.K, dtype=torch.float32) / cfg.gamma)
        self.eval_info: dict = {}

    @property
    def parts_label(self) -> str:
        return "ce, l1, bce" if self.method == "dspark" else "soft ce"

    def _features(self, b):
        if b.aux is None:
            raise ValueError(f"{self.method} reads the target's aux features; the data has none "
                             "(CorpusData needs aux_ids, FileData n_aux = len(aux_layer_ids))")
        return b.aux

    def _slot_logits(self, h, prev):
        return self.m.slot_logits(h, prev) if self.method == "dspark" else self.m.logits(h)

    def loss(self, b):
        m, K = self.m, self.K
        lengths = b.mask.sum(1)
        anchors, keep = sample_anchors(lengths, self.cfg.num_anchors, self.gen, last=1)
        h = dense_block(m, self._features(b), b.ids, anchors)[:, :, self.off:]   # [B, n, K, H]
        k = torch.arange(K)
        lab = anchors[:, :, None] + 1 + k                                   # [B, n, K]
        valid = keep[:, :, None] & (lab < lengths[:, None, None])
        w = self.w * valid.float()
        den = w.sum().clamp_min(1e-6)
        tl = _gather_rows(b.logits, lab - 1)                                # [B, n, K, V]
        prev = _gather_rows(b.ids, lab - 1)                                 # x_{a+k}
        logits = self._slot_logits(h, prev)                                 # fp32 [B, n, K, V]
        logq = torch.log_softmax(logits, dim=-1)
        p_t = torch.softmax(tl.float(), dim=-1)
        if self.method == "dflash":
            ce = -(p_t * logq).sum(-1)
            loss = (ce * w).sum() / den
            return loss, [float(loss.detach())]
        gold = _gather_rows(b.ids, lab)
        ce = (-logq.gather(-1, gold[..., None])[..., 0] * w).sum() / den
        l1_tok = (logq.exp() - p_t).abs().sum(-1)
        l1 = (l1_tok * w).sum() / den
        accept = (1 - 0.5 * l1_tok.detach()).clamp(0, 1)
        bce_tok = F.binary_cross_entropy_with_logits(confidence_logit(m, h, prev), accept,
                                                     reduction="none")
        bce = (bce_tok * w).sum() / den
        loss = DSPARK_CE * ce + DSPARK_L1 * l1 + DSPARK_BCE * bce
        return loss, [float(ce.detach()), float(l1.detach()), float(bce.detach())]

    # -- held-out acceptance, as serving verifies -----------------------------------------------
    @torch.no_grad()
    def draft(self, feats, ids, anchors):
        """Greedy drafts [B, n, K] and the confidences [B, n, K] serving computes (DSpark: the
        sigmoid head over its own drafts; DFlash: the max softmax of each slot)."""
        h = dense_block(self.m, feats, ids, anchors)[:, :, self.off:]
        if self.method == "dflash":
            p = torch.softmax(self.m.logits(h), dim=-1)
            conf, d = p.max(-1)
            return d, conf
        prev = ids.gather(1, anchors)
        toks, confs = [], []
        for j in range(self.K):
            toks.append(self.m.slot_logits(h[:, :, j], prev).argmax(-1))
            confs.append(self.m.confidence(h[:, :, j], prev))
            prev = toks[-1]
        return torch.stack(toks, -1), torch.stack(confs, -1)

    @torch.no_grad()
    def verify(self, ids, anchors, keep, drafts):
        """The target's greedy token at every draft position, given the anchor's prefix and the
        drafts before it: one causal forward over [x_0..x_a, d_1..d_{K-1}] per anchor.
        -> greedy [B, n, K] (rows with keep False are -1)."""
        B, n, K = drafts.shape
        out = torch.full((B, n, K), -1, dtype=torch.long)
        rows = [(b, i) for b in range(B) for i in range(n) if keep[b, i]]
        rows.sort(key=lambda r: int(anchors[r]))                # similar lengths share a call
        for s in range(0, len(rows), VERIFY_ROWS):
            chunk = rows[s:s + VERIFY_ROWS]
            L = int(anchors[chunk[-1]]) + K
            x = torch.zeros(len(chunk), L, dtype=torch.long)  # right padding: causal, unread
            for r, (b, i) in enumerate(chunk):
                a = int(anchors[b, i])
                x[r, :a + 1] = ids[b, :a + 1]
                x[r, a + 1:a + K] = drafts[b, i, :K - 1]
            logits = self.target.forward_causal(x)                          # [R, L, V]
            for r, (b, i) in enumerate(chunk):
                a = int(anchors[b, i])
                out[b, i] = logits[r, a:a + K].argmax(-1)
        return out

    @torch.no_grad()
    def evaluate(self, eval_set) -> tuple[list, float]:
        was = self.m.training
        self.m.eval()
        acc_sum = torch.zeros(self.K)
        cond_hit, cond_n, conf_sum = torch.zeros(self.K), torch.zeros(self.K), torch.zeros(self.K)
        total = 0
        for i, b in enumerate(eval_set):
            gen = torch.Generator().manual_seed(EVAL_SEED + i)     # the same anchors every eval
            anchors, keep = sample_anchors(b.mask.sum(1), self.cfg.eval_anchors, gen, last=0)
            d, conf = self.draft(self._features(b), b.ids, anchors)
            g = self.verify(b.ids, anchors, keep, d)
            hit = (d == g) & keep[:, :, None]                                   # [B, n, K]
            run = hit.long().cumprod(-1).bool()                                 # accepted 1..k
            acc_sum += run.float().sum((0, 1))
            total += int(keep.sum())
            # confidence vs the observed acceptance of slot k given drafts < k were accepted
            prefix = torch.cat([keep[:, :, None], run[:, :, :-1]], -1)
            cond_n += prefix.float().sum((0, 1))
            cond_hit += (prefix & hit).float().sum((0, 1))
            conf_sum += (conf * prefix).sum((0, 1))
        self.m.train(was)
        acc = (acc_sum / max(total, 1)).tolist()
        def per_slot(x):  # None where no anchor's prefix reached slot k
            return [round(v / c, 4) if c else None for v, c in zip(x.tolist(), cond_n.tolist())]

        self.eval_info = {"anchors": total, "conditional_acceptance": per_slot(cond_hit),
                          "mean_confidence": per_slot(conf_sum)}
        return acc, 1.0 + sum(acc)


def check_block_config(cfg) -> None:
    """Resolve and validate TrainConfig's block-drafter fields (called from __post_init__)."""
    block = cfg.method in BLOCK_METHODS
    for name in ("block_size", "num_anchors", "draft_layers", "gamma", "eval_anchors"):
        if not block and getattr(cfg, name) is not None:
            raise ValueError(f"{name}={getattr(cfg, name)!r} applies to methods "
                             f"{' and '.join(BLOCK_METHODS)} only; drop it for {cfg.method!r}")
    if not block:
        return
    if cfg.block_size is None:
        cfg.block_size = 16 if cfg.method == "dflash" else 7   # z-lab -b16, DeepSpec block7
    cfg.num_anchors = 16 if cfg.num_anchors is None else cfg.num_anchors
    cfg.draft_layers = 1 if cfg.draft_layers is None else cfg.draft_layers
    cfg.gamma = 4.0 if cfg.gamma is None else cfg.gamma
    cfg.eval_anchors = 8 if cfg.eval_anchors is None else cfg.eval_anchors
    least = 2 if cfg.method == "dflash" else 1
    if cfg.block_size < least:
        what = "the anchor and one MASK" if least == 2 else "the anchor"
        raise ValueError(f"block_size={cfg.block_size}: a {cfg.method} block needs at least "
                         f"{least} slot(s) ({what}); set it to {least} or more")
    for name in ("num_anchors", "draft_layers", "eval_anchors"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}={getattr(cfg, name)}: must be >= 1")
    if not (cfg.gamma > 0 and math.isfinite(cfg.gamma)):
        raise ValueError(f"gamma={cfg.gamma}: the position-weight decay exp(-k/gamma) needs a "
                         "finite gamma > 0 (DeepSpec uses 4.0)")
