"""Train a hidden-state drafter (EAGLE-3, EAGLE, Medusa, MTP, DFlash, DSpark) for a target model
on one machine.

    from npuspec.models import load_model, load_tokenizer
    from npuspec.models.train_draft import TrainConfig, CorpusData, stdlib_corpus, train

    tcfg, target = load_model("tiny")
    cfg = TrainConfig(method="eagle3", steps=800)
    corpus = stdlib_corpus(load_tokenizer("tiny"))
    data = CorpusData(target, corpus.train, corpus.val, aux_ids=...)   # or FileData(...)
    result = train(target, data, cfg, state_dir="out/train_state")     # -> TrainResult
    save_trained(result.module, "out")                                  # load_draft reads it

`npuspec train-draft` (npuspec/cli/train_draft.py, docs/train_draft.md) is the command line.

The module trained is exactly the serving module (`EagleDraft`, `Eagle3Draft`, `MedusaHeads`,
`MTPDraft`, `DFlashDraft`, `DSparkDraft`): its own parameters are the ones optimized, and
`save_draft` writes them. Their serving forward is paged (a KV pool and `paged_attention`,
which has no autograd), so this file has a dense causal forward over the same submodules
(`dense_chain`, `dense_medusa`; `train_block.dense_block`); tests check it equals the paged
forward. What the draft shares with the target (its embedding, its
LM head) is the target's own tensor and stays frozen.

Data rows (drafters.md §1.5, §9.4). A sequence of N tokens x_0..x_{N-1} with target features
f_j and target logits z_j gives N-1 rows; at TTT / chain step s, row j reads token x_{j+1+s}
at position j+s and is trained towards softmax(z_{j+1+s}), the target's distribution of
x_{j+2+s}. Step 0 reads the target feature f_j; step s > 0 reads the draft's own hidden of
step s-1 at the same row. Attention at step s ("TTT pattern"): the step-0 keys of rows <= j,
plus the keys of steps 1..s of row j itself; this is exactly what the paged chain sees in
serving (the first pass's K/V at positions 0..j, then its own K/V at j+1..j+s).

Losses, all soft cross-entropies against the target's own distributions (soft labels):
    eagle3  sum_s 0.8^s CE_s over `ttt_steps` steps, in the draft vocabulary (Vd < V: the
            top-Vd training tokens; the target's distribution renormalized over them, rows
            whose target argmax is outside masked out)
    eagle   sum_s 0.8^s [smooth_l1(h_s, f_{j+1+s}) + 0.1 CE_s(target_head(h_s))] (EAGLE-1's
            feature regression; f = the target's post-norm final hidden); ttt_steps=1 default
    mtp     sum_s 0.8^s CE_s (step 0: x_{j+1} with the target's post-norm h_j; steps > 0
            recycle the MTP's own post-norm output, for K > 1 reuse); ttt_steps=1 default
    medusa  sum_k 0.8^k CE(head k at row j, softmax(z_{j+1+k})) (head k drafts x_{j+2+k})

DFlash and DSpark (block drafters) have their own dense forward, losses and held-out metric
(serving's verification of greedy blocks) in `npuspec.models.train_block`.

Held-out acceptance (the chain and Medusa methods): teacher-forced top-1 agreement a_k of the
draft's argmax with the target's argmax at draft position k (k = 1..K), and the implied expected
acceptance length 1 + sum_k prod_{i<=k} a_i (tokens per target step of a K-token chain).

Checkpoints (`state_dir`): weights, AdamW state and both RNG states in one safetensors file
plus a JSON; no pickles. Resuming reproduces the uninterrupted run bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from npuspec.models.config import ModelConfig
from npuspec.models.draft_loading import (DraftConfig, default_aux_layer_ids,
                                          default_block_aux_ids, save_draft)
from npuspec.models.train_block import BLOCK_METHODS, BlockObjective, check_block_config

METHODS = ("eagle3", "eagle", "medusa", "mtp") + BLOCK_METHODS
STATE_FORMAT = 1
EVAL_SEED = 1234
CLS_WEIGHT = 0.1   # EAGLE-1: weight of the classification loss next to the feature regression


# --------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass
class TrainConfig:
    method: str = "eagle3"
    steps: int = 800
    batch: int = 16
    seq_len: int = 128             # rows per sequence (the window holds seq_len + 1 tokens)
    lr: float = 5e-3                # tuned for the embedded model; ~1e-4 for billion-scale targets
    warmup: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    ttt_steps: Optional[int] = None  # eagle3: 3; eagle, mtp: 1 (extra recycled steps if > 1)
    decay: float = 0.8               # step / head weights decay**s
    draft_vocab_size: Optional[int] = None  # eagle3 Vd (None: the target's V)
    num_heads: int = 4               # medusa heads
    eval_every: int = 100
    eval_k: int = 4                  # draft positions scored (medusa: num_heads)
    eval_batches: int = 4
    save_every: int = 100
    # dflash / dspark (train_block.py; None = the method's default, and unset for the others)
    block_size: Optional[int] = None    # query slots per block: 16 (dflash), 7 (dspark)
    num_anchors: Optional[int] = None   # random anchors (blocks) per training sequence: 16
    draft_layers: Optional[int] = None  # decoder layers of the draft: 1
    gamma: Optional[float] = None       # position weights exp(-k/gamma): 4.0
    eval_anchors: Optional[int] = None  # held-out anchors per eval sequence: 8

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: choose one of {', '.join(METHODS)}")
        check_block_config(self)
        if self.ttt_steps is None:
            self.ttt_steps = 3 if self.method == "eagle3" else 1
        for name in ("steps", "batch", "seq_len", "ttt_steps", "num_heads", "eval_k",
                     "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.seq_len < self.positions + 1:
            raise ValueError(f"seq_len={self.seq_len} must exceed the {self.positions} draft "
                             f"positions trained and scored")
        if self.method != "eagle3" and self.draft_vocab_size is not None:
            raise ValueError("draft_vocab_size applies to method 'eagle3' only")

    @property
    def positions(self) -> int:
        """Draft positions scored at eval (and the most steps any loss runs)."""
        if self.method == "medusa":
            return self.num_heads
        if self.method in BLOCK_METHODS:  # the whole block: serving's K at this block size
            return self.block_size - (1 if self.method == "dflash" else 0)
        return max(self.eval_k, self.ttt_steps)

    # fields that change the trajectory: a resumed run must agree on all of them (a field a
    # checkpoint predates reads as None, which is what the methods that lack it hold)
    TRAJECTORY = ("method", "steps", "batch", "seq_len", "lr", "warmup", "weight_decay",
                  "grad_clip", "seed", "ttt_steps", "decay", "draft_vocab_size", "num_heads",
                  "block_size", "num_anchors", "draft_layers", "gamma")


@dataclasses.dataclass
class Batch:
    """N tokens per row and what the target computed on them (fp32)."""
    ids: torch.Tensor                 # int64 [B, N]
    mask: torch.Tensor                # bool [B, N]: real tokens (right padding is False)
    final: torch.Tensor               # [B, N, H] the target's post-norm final hidden
    logits: torch.Tensor              # [B, N, V] the target's logits
    aux: Optional[torch.Tensor] = None  # [B, N, n_aux*H] EAGLE-3 aux features

    @property
    def rows(self) -> int:
        return self.ids.shape[1] - 1


def _shift(x: torch.Tensor, k: int, rows: int) -> torch.Tensor:
    """x[:, k:k+rows] zero-padded on the right to `rows` (dim 1)."""
    out = x[:, k:k + rows]
    pad = rows - out.shape[1]
    if pad > 0:
        shape = list(out.shape)
        shape[1] = pad
        out = torch.cat([out, out.new_zeros(shape)], dim=1)
    return out


# --------------------------------------------------------------------------------------------
# data


@dataclasses.dataclass
class Corpus:
    train: torch.Tensor   # token ids, files separated by `sep`
    val: torch.Tensor
    info: dict


def stdlib_corpus(tokenizer, max_files: int = 0, sep_id: Optional[int] = None) -> Corpus:
    """The embedded model's corpus (npuspec.models.train_tiny): the stdlib's *.py files, the
    same last 2% held out for validation. Files that contain one of the built-in demo / bench
    prompts (npuspec/cli/prompts.py) are dropped, so acceptance on them is not memorized."""
    from npuspec.cli.prompts import DEMO_PROMPTS, code_edit_requests
    from npuspec.models.train_tiny import EOT, read_texts, stdlib_files

    files = stdlib_files()
    if max_files:
        files = files[:max_files]
    if len(files) < 2:
        raise ValueError("the stdlib corpus needs at least 2 files (one held out)")
    n_val = max(1, len(files) // 50)
    prompts = [p for p in DEMO_PROMPTS] + [r["code"] for r in code_edit_requests()]
    texts = read_texts(files)
    keep = [not any(p in t for p in prompts) for t in texts]
    dropped = [f for f, k in zip(files, keep) if not k]
    if sep_id is None:
        sep_id = tokenizer.token_to_id(EOT)
    if sep_id is None:
        raise ValueError("the tokenizer has no <|endoftext|> token; pass sep_id (the target's "
                         "eos_token_id) to separate files")

    def encode(ts):
        ids = []
        for enc in tokenizer.encode_batch(ts):
            ids += enc.ids
            ids.append(sep_id)
        return torch.tensor(ids, dtype=torch.int32)

    tr = [t for t, k in zip(texts[:-n_val], keep[:-n_val]) if k]
    va = [t for t, k in zip(texts[-n_val:], keep[-n_val:]) if k]
    train_ids, val_ids = encode(tr), encode(va)
    import sysconfig
    info = {"source": "stdlib", "root": sysconfig.get_paths()["stdlib"],
            "python": sys.version.split()[0], "train_files": len(tr), "val_files": len(va),
            "held_out": [os.path.basename(f) for f in files[-n_val:]][:20],
            "dropped_for_prompts": [os.path.basename(f) for f in dropped],
            "train_tokens": int(train_ids.numel()), "val_tokens": int(val_ids.numel())}
    return Corpus(train_ids, val_ids, info)


def _target_split(target, aux_ids: tuple, ids: torch.Tensor):
    """Run the target on ids [B, N] -> (logits, final post-norm hidden, aux or None)."""
    with torch.no_grad():
        logits, feats = target.forward_causal(ids, aux_ids=tuple(aux_ids), final=True)
    H = target.config.hidden_size
    aux = feats[..., :-H] if aux_ids else None
    return logits.float(), feats[..., -H:].float(), None if aux is None else aux.float()


class CorpusData:
    """Random windows of a token stream; the target computes features and logits each batch."""

    def __init__(self, target, train_ids: torch.Tensor, val_ids: torch.Tensor,
                 aux_ids: tuple = (), info: Optional[dict] = None):
        self.target, self.aux_ids = target, tuple(aux_ids)
        self.train_ids, self.val_ids = train_ids, val_ids
        self.info = {"source": "corpus", **(info or {})}

    def _windows(self, data, gen, B, N):
        if len(data) < N + 1:
            raise ValueError(f"the corpus split has {len(data)} tokens, fewer than one window "
                             f"of {N}; use a smaller seq_len or more files")
        starts = torch.randint(0, len(data) - N, (B,), generator=gen)
        return data[starts[:, None] + torch.arange(N)].long()

    def _batch(self, ids):
        logits, final, aux = _target_split(self.target, self.aux_ids, ids)
        return Batch(ids, torch.ones_like(ids, dtype=torch.bool), final, logits, aux)

    def sample(self, gen: torch.Generator, B: int, N: int) -> Batch:
        return self._batch(self._windows(self.train_ids, gen, B, N))

    def eval_set(self, n: int, B: int, N: int) -> list[Batch]:
        gen = torch.Generator().manual_seed(EVAL_SEED)
        return [self._batch(self._windows(self.val_ids, gen, B, N)) for _ in range(n)]

    def token_counts(self, V: int) -> torch.Tensor:
        return torch.bincount(self.train_ids.long(), minlength=V)[:V]


class FileData:
    """extract_hidden_states files (`npuspec.engine.hidden_states`): token_ids [T] and
    hidden_states [T, n, H] captured with layer ids aux + [L] (L = num_hidden_layers: the final
    residual before the norm, from which the target's logits are recomputed). `n_aux` is how many
    leading layers are EAGLE-3 aux features (0 for the other methods, which use only the last)."""

    def __init__(self, target, files: Sequence[str], n_aux: int = 0, val_fraction: float = 0.1):
        files = sorted(files)
        if len(files) < 2:
            raise ValueError(f"--data: {len(files)} hidden states file(s); need at least 2 "
                             "(one is held out for validation)")
        self.target, self.n_aux = target, n_aux
        n_val = max(1, int(round(len(files) * val_fraction)))
        self.train_files, self.val_files = files[:-n_val], files[-n_val:]
        self.info = {"source": "hidden_states_files",
                     "dir": os.path.dirname(os.path.abspath(files[0])),
                     "train_files": len(self.train_files), "val_files": len(self.val_files)}
        self._check(self._load(files[0]), files[0])

    def _load(self, path):
        from npuspec.engine.hidden_states import load_hidden_states
        return load_hidden_states(path)

    def _check(self, d, path):
        hs = d["hidden_states"]
        H, L = self.target.config.hidden_size, self.target.config.num_layers
        ok = hs.dim() == 3 and hs.shape[2] == H and (
            hs.shape[1] == self.n_aux + 1 if self.n_aux else hs.shape[1] >= 1)
        if not ok or d["token_ids"].shape[0] != hs.shape[0]:
            want = f"[T, {self.n_aux + 1}, {H}]" if self.n_aux else f"[T, n, {H}]"
            raise ValueError(
                f"{path}: hidden_states has shape {list(hs.shape)}, expected {want}: capture "
                f"with eagle_aux_hidden_state_layer_ids = aux ids + [{L}] (the aux layer(s), "
                f"then layer {L}: the final residual before the norm, always last)")

    def _rows(self, path, gen, N):
        d = self._load(path)
        self._check(d, path)
        tok, hs = d["token_ids"].long(), d["hidden_states"]
        T = tok.shape[0]
        start = int(torch.randint(0, T - N + 1, (1,), generator=gen)) if T > N else 0
        return tok[start:start + N], hs[start:start + N].float()

    def _batch(self, rows, N):
        B = len(rows)
        n, H = rows[0][1].shape[1], self.target.config.hidden_size
        ids = torch.zeros(B, N, dtype=torch.long)
        mask = torch.zeros(B, N, dtype=torch.bool)
        hs = torch.zeros(B, N, max(n, self.n_aux + 1), H)
        for b, (t, h) in enumerate(rows):
            if h.shape[1] != n:
                raise ValueError("--data: the files hold different numbers of layers; capture "
                                 "them all with the same eagle_aux_hidden_state_layer_ids")
            ids[b, :len(t)], mask[b, :len(t)], hs[b, :len(t)] = t, True, h
        if int(ids.max()) >= self.target.config.vocab_size:
            raise ValueError("--data: token ids beyond the target's vocabulary; the files were "
                             "captured with another model")
        with torch.no_grad():
            final = self.target.final_norm(hs[:, :, -1]).float()
            logits = self.target.head(final).float()
        aux = hs[:, :, :self.n_aux].flatten(2) if self.n_aux else None
        return Batch(ids, mask, final, logits, aux)

    def sample(self, gen: torch.Generator, B: int, N: int) -> Batch:
        pick = torch.randint(0, len(self.train_files), (B,), generator=gen).tolist()
        return self._batch([self._rows(self.train_files[i], gen, N) for i in pick], N)

    def eval_set(self, n: int, B: int, N: int) -> list[Batch]:
        gen = torch.Generator().manual_seed(EVAL_SEED)
        out = []
        for i in range(n):
            files = [self.val_files[(i * B + b) % len(self.val_files)] for b in range(B)]
            out.append(self._batch([self._rows(f, gen, N) for f in files], N))
        return out

    def token_counts(self, V: int) -> torch.Tensor:
        from safetensors import safe_open
        counts = torch.zeros(V, dtype=torch.long)
        for f in self.train_files:
            with safe_open(f, framework="pt") as fh:
                counts += torch.bincount(fh.get_tensor("token_ids").long(), minlength=V)[:V]
        return counts


def hidden_state_files(directory: str) -> list[str]:
    import glob
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"--data {directory!r}: no *.safetensors hidden states files "
                                "(written by LLM(speculative_config={'method': "
                                "'extract_hidden_states', ...}, kv_transfer_config=...))")
    return files


# --------------------------------------------------------------------------------------------
# the dense forwards


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
    h = m.fc(torch.cat([e, hidden], dim=-1))
    for i, layer in enumerate(m.layers):
        x = h if layer.input_layernorm is None else layer.input_layernorm(h)
        h = layer(x, h, cos, sin, attend(i))
    return h, h


def _step_mtp(m, ids, hidden, positions, cos, sin, attend):
    layer = m.layers[0]
    e = _embed(m, ids, hidden.dtype, layer.embed_tokens)
    e = e.masked_fill((positions == 0)[..., None], 0.0)  # vLLM: nothing precedes position 0
    h0 = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(hidden)], dim=-1))
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


# --------------------------------------------------------------------------------------------
# building a fresh draft


def draft_vocab(counts: torch.Tensor, Vd: int) -> torch.Tensor:
    """The Vd most frequent token ids, sorted ascending (EAGLE's vocabulary map)."""
    V = counts.numel()
    if not 1 <= Vd <= V:
        raise ValueError(f"draft_vocab_size={Vd}: must be in 1..{V} (the target's vocab_size)")
    if Vd == V:
        return torch.arange(V)
    # ties broken by the lower id, so the map is deterministic
    order = sorted(range(V), key=lambda i: (-int(counts[i]), i))[:Vd]
    return torch.tensor(sorted(order), dtype=torch.long)


def build_draft(method: str, tcfg: ModelConfig, target, cfg: TrainConfig,
                used: Optional[torch.Tensor] = None, aux_ids: Optional[tuple] = None):
    """A fresh draft module for `target`, initialized from torch's global RNG: EAGLE-3's
    lm_head from the target's head rows `used`; Medusa's heads from the target's head, its
    residual blocks at zero (each head starts as the target's next-token head)."""
    from npuspec.models.draft_loading import _CLASSES

    W = target_head_weight(target).detach().float()
    over = {}
    if method == "eagle3":
        used = torch.arange(tcfg.vocab_size) if used is None else used
        over = dict(draft_vocab_size=int(used.numel()),
                    aux_layer_ids=tuple(aux_ids or default_aux_layer_ids(tcfg.num_layers)))
    elif method == "medusa":
        over = dict(medusa_num_heads=cfg.num_heads)
    elif method in BLOCK_METHODS:
        over = dict(num_layers=cfg.draft_layers, block_size=cfg.block_size,
                    aux_layer_ids=tuple(aux_ids or default_block_aux_ids(tcfg.num_layers,
                                                                         cfg.draft_layers)))
    dcfg = DraftConfig.from_target(method, tcfg, **over)
    module = _CLASSES[method](dcfg)
    with torch.no_grad():
        if getattr(module, "mask_embedding", None) is not None:
            # start MASK where the target embeds the mask id: a zero vector would meet the
            # first RMSNorm at its eps, with a ~1/sqrt(eps) gradient
            module.mask_embedding.copy_(target.embed_tokens(
                torch.tensor([dcfg.mask_token_id]))[0].float())
        if getattr(module, "markov_head", None) is not None:
            # the Markov bias starts at 0: the first blocks are the backbone's alone
            module.markov_head.markov_w2.weight.zero_()
        if method == "eagle3":
            module.d2t.copy_(used - torch.arange(used.numel()))
            module.lm_head.weight.copy_(W[used])
            module.init_buffers()
        elif method == "medusa":
            for blocks in module.blocks:
                for layer in blocks.layers:
                    layer.weight.zero_()
                    if layer.bias is not None:
                        layer.bias.zero_()
            for head in module.lm_heads:
                head.weight.copy_(W)
    module.bind_target(target)
    return module.float()


# --------------------------------------------------------------------------------------------
# losses and predictions


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over mask of -sum p log q, p = softmax(target_logits), q = softmax(logits)."""
    p = torch.softmax(target_logits.float(), dim=-1)
    ce = -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
    m = mask.float()
    return (ce * m).sum() / m.sum().clamp_min(1.0)


class _Objective:
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


def expected_acceptance_length(acc: Sequence[float]) -> float:
    """1 + sum_k prod_{i<=k} a_i."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


# --------------------------------------------------------------------------------------------
# checkpoints (no pickles)


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _gen_state_tensor(state: torch.Tensor) -> torch.Tensor:
    return state.clone().to(torch.uint8)


def save_state(state_dir: str, module, opt, gen: torch.Generator, step: int, cfg: TrainConfig,
               history: dict, extra: dict) -> None:
    """Write state_dir/{state.safetensors, state.json} atomically (a temp dir renamed over)."""
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for key, val in opt.state.get(p, {}).items():
            t = val if isinstance(val, torch.Tensor) else torch.tensor(val)
            tensors[f"opt.{i}.{key}"] = t.detach().contiguous().cpu()
    tensors["rng.torch"] = _gen_state_tensor(torch.get_rng_state())
    tensors["rng.data"] = _gen_state_tensor(gen.get_state())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    meta = {"format": STATE_FORMAT, "step": step, "config": dataclasses.asdict(cfg),
            "param_groups": groups, "num_params": len(params), "history": history, **extra}
    parent = os.path.dirname(os.path.abspath(state_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{os.path.abspath(state_dir)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "state.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump(meta, f, indent=1)
    old = f"{os.path.abspath(state_dir)}.old-{os.getpid()}"
    if os.path.isdir(state_dir):
        os.replace(state_dir, old)
    os.replace(tmp, state_dir)
    shutil.rmtree(old, ignore_errors=True)


def load_state(state_dir: str) -> tuple[dict, dict]:
    """-> (meta from state.json, tensors from state.safetensors)."""
    from safetensors.torch import load_file

    jpath = os.path.join(state_dir, "state.json")
    if not os.path.isfile(jpath):
        raise FileNotFoundError(f"--resume: no checkpoint at {jpath}; run without --resume "
                                "first (checkpoints are written every --save-every steps)")
    with open(jpath) as f:
        meta = json.load(f)
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{jpath}: checkpoint format {meta.get('format')} is not "
                         f"{STATE_FORMAT}; it was written by another npuspec version")
    return meta, load_file(os.path.join(state_dir, "state.safetensors"))


def _restore(meta, tensors, module, opt, gen, cfg: TrainConfig, data_info: dict):
    old = meta["config"]
    diff = [f"{k}: {old.get(k)!r} -> {getattr(cfg, k)!r}" for k in TrainConfig.TRAJECTORY
            if old.get(k) != getattr(cfg, k)]
    if diff:
        raise ValueError("--resume: the checkpoint was written with other settings ("
                         + "; ".join(diff) + "); rerun with the same ones, or train afresh "
                         "without --resume")
    if meta.get("data") != _data_key(data_info):
        raise ValueError(f"--resume: the checkpoint was trained on other data "
                         f"({meta.get('data')}); use the same --data / corpus")
    sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    module.load_state_dict(sd, strict=True)
    if hasattr(module, "init_buffers"):
        module.init_buffers()
    params = [p for g in opt.param_groups for p in g["params"]]
    if meta["num_params"] != len(params):
        raise ValueError("--resume: the checkpoint's optimizer does not match this draft")
    state = {}
    for i in range(len(params)):
        st = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"opt.{i}.")}
        if st:
            state[i] = st
    groups = [{**g, "params": [sum(len(x["params"]) for x in opt.param_groups[:j]) + n
                               for n in range(len(opt.param_groups[j]["params"]))]}
              for j, g in enumerate(meta["param_groups"])]
    opt.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(tensors["rng.torch"])
    gen.set_state(tensors["rng.data"])
    return meta["step"], meta.get("history") or {}


def _data_key(info: dict) -> dict:
    return {k: info.get(k) for k in ("source", "dir", "root", "train_files", "val_files",
                                     "train_tokens")}


# --------------------------------------------------------------------------------------------
# the loop


@dataclasses.dataclass
class TrainResult:
    module: object
    steps: int
    final_loss: float
    acceptance: list          # held-out a_k, k = 1..positions
    acceptance_length: float  # 1 + sum_k prod a
    history: dict             # {"step": [...], "loss": [...], "eval": [{step, acc, al}]}
    train_seconds: float


def evaluate(obj: _Objective, eval_set: list[Batch], K: int) -> tuple[list, float]:
    if isinstance(obj, BlockObjective):  # serving's verify, not teacher-forced agreement
        return obj.evaluate(eval_set)
    hits, counts = [0] * K, [0] * K
    was = obj.m.training
    obj.m.eval()
    for b in eval_set:
        h, c = obj.agreement(b, K)
        hits = [x + y for x, y in zip(hits, h)]
        counts = [x + y for x, y in zip(counts, c)]
    obj.m.train(was)
    acc = [h / c if c else 0.0 for h, c in zip(hits, counts)]
    return acc, expected_acceptance_length(acc)


def train(target, data, cfg: TrainConfig, state_dir: Optional[str] = None, *,
          resume: bool = False, aux_ids: Optional[tuple] = None,
          log: Callable[[str], None] = print, on_step: Optional[Callable[[int], None]] = None,
          stop_after: int = 0) -> TrainResult:
    """Train a fresh `cfg.method` draft for `target` on `data` (CorpusData / FileData).
    Deterministic for a given cfg.seed and thread count. `state_dir`: where checkpoints go
    every cfg.save_every steps and at the end; `resume` continues from the one there.
    `stop_after` stops after that many steps of the schedule (to test resuming)."""
    tcfg = target.config
    target.requires_grad_(False)
    if resume:
        if state_dir is None:
            raise ValueError("resume needs a state_dir")
        meta, tensors = load_state(state_dir)  # before any work: a missing one fails at once
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    used = None
    if cfg.method == "eagle3":
        Vd = cfg.draft_vocab_size or tcfg.vocab_size
        used = draft_vocab(data.token_counts(tcfg.vocab_size) if Vd < tcfg.vocab_size
                           else torch.ones(tcfg.vocab_size), Vd)
    module = build_draft(cfg.method, tcfg, target, cfg, used, aux_ids)
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    obj = (BlockObjective(module, target, cfg, gen) if cfg.method in BLOCK_METHODS
           else _Objective(module, target, cfg))
    N = cfg.seq_len + 1
    K = cfg.positions
    eval_set = data.eval_set(cfg.eval_batches, cfg.batch, N)
    history = {"step": [], "loss": [], "eval": []}
    start = 0
    if resume:
        start, history = _restore(meta, tensors, module, opt, gen, cfg, data.info)
        log(f"resumed from {state_dir} at step {start}")
    extra = {"data": _data_key(data.info)}
    last = min(cfg.steps, stop_after or cfg.steps)
    t0 = time.perf_counter()
    loss_v = float("nan")
    acc, al = [], 0.0
    for step in range(start, last):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        batch = data.sample(gen, cfg.batch, N)
        loss, parts = obj.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        loss_v = float(loss.detach())
        history["step"].append(step + 1)
        history["loss"].append(round(loss_v, 5))
        if on_step is not None:
            on_step(step + 1)
        done = step + 1
        if (cfg.eval_every and done % cfg.eval_every == 0) or done == last:
            acc, al = evaluate(obj, eval_set, K)
            history["eval"].append({"step": done, "acceptance": [round(a, 4) for a in acc],
                                    "acceptance_length": round(al, 4), "loss": round(loss_v, 5),
                                    **getattr(obj, "eval_info", {})})
            label = getattr(obj, "parts_label", "per step")
            log(f"step {done}/{cfg.steps} loss {loss_v:.4f} ({label} "
                f"{', '.join(f'{p:.3f}' for p in parts)}) held-out acceptance "
                f"{' '.join(f'{a:.3f}' for a in acc)} -> expected acceptance length {al:.3f} "
                f"(K={K}) {time.perf_counter() - t0:.0f}s")
        if state_dir and ((cfg.save_every and done % cfg.save_every == 0) or done == last):
            save_state(state_dir, module, opt, gen, done, cfg, history, extra)
    if start >= last:  # nothing left to do: score what was restored
        acc, al = evaluate(obj, eval_set, K)
        if history["loss"]:
            loss_v = history["loss"][-1]
    module.eval()
    return TrainResult(module, last, loss_v, acc, al, history, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# output


def save_trained(module, out_dir: str, dtype: Optional[torch.dtype] = None,
                 target_dir: Optional[str] = None) -> str:
    """Write the trained draft for serving: eagle3 (SpecForge format), eagle, medusa (vLLM
    format) as a draft directory; mtp into `out_dir`, a target checkpoint directory (copied from
    `target_dir` first when `out_dir` has no config.json), as model.layers.{L}.* in mtp.safetensors
    plus num_nextn_predict_layers in its config.json."""
    if module.method != "mtp":
        return save_draft(module, out_dir, dtype=dtype)
    if not os.path.isfile(os.path.join(out_dir, "config.json")):
        if target_dir is None or not os.path.isdir(target_dir):
            raise ValueError(f"MTP: {out_dir} is not a target checkpoint directory, and the "
                             "target is not an HF directory to copy; pass --out an HF copy of "
                             "the target")
        os.makedirs(out_dir, exist_ok=True)
        for name in sorted(os.listdir(target_dir)):
            src = os.path.join(target_dir, name)
            if os.path.isfile(src) and name != "mtp.safetensors":
                shutil.copy2(src, os.path.join(out_dir, name))
                os.chmod(os.path.join(out_dir, name), 0o644)
    return save_draft(module, out_dir, fmt="deepseek", dtype=dtype)
