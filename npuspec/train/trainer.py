"""The training loop: a fresh draft for the target (`build_draft`), AdamW with warmup and a
cosine schedule, held-out acceptance every `eval_every` steps, checkpoints, and the written
draft (`save_trained`)."""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from typing import Callable, Optional, Sequence

import torch

from npuspec.models.config import ModelConfig
from npuspec.models.draft_config import DraftConfig, default_aux_layer_ids, default_block_aux_ids
from npuspec.models.draft_loading import _CLASSES, save_draft
from npuspec.train.block import BLOCK_METHODS, BlockObjective
from npuspec.train.chain import ChainObjective, target_head_weight
from npuspec.train.checkpoint import data_key, load_state, restore, save_state
from npuspec.train.config import TrainConfig
from npuspec.train.data import Batch


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



def expected_acceptance_length(acc: Sequence[float]) -> float:
    """1 + sum_k prod_{i<=k} a_i."""
    total, run = 1.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total



def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))



@dataclasses.dataclass
class TrainResult:
    module: object
    steps: int
    final_loss: float
    acceptance: list          # held-out a_k, k = 1..positions
    acceptance_length: float  # 1 + sum_k prod a
    history: dict             # {"step": [...], "loss": [...], "eval": [{step, acc, al}]}
    train_seconds: float


def evaluate(obj: ChainObjective, eval_set: list[Batch], K: int) -> tuple[list, float]:
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
          stop_after: int = 0, state_extra: Optional[dict] = None) -> TrainResult:
    """Train a fresh `cfg.method` draft for `target` on `data` (CorpusData / FileData).
    Deterministic for a given cfg.seed and thread count. `state_dir`: where checkpoints go
    every cfg.save_every steps and at the end; `resume` continues from the one there.
    `stop_after` stops after that many steps of the schedule (to test resuming).
    `state_extra`: more JSON for every checkpoint's state.json (the CLI's resume command)."""
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
           else ChainObjective(module, target, cfg))
    N = cfg.seq_len + 1
    K = cfg.positions
    eval_set = data.eval_set(cfg.eval_batches, cfg.batch, N)
    history = {"step": [], "loss": [], "eval": []}
    start = 0
    if resume:
        start, history = restore(meta, tensors, module, opt, gen, cfg, data.info)
        log(f"resumed from {state_dir} at step {start}")
    extra = {**(state_extra or {}), "data": data_key(data.info)}
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



def save_trained(module, out_dir: str, dtype: Optional[torch.dtype] = None,
                 target_dir: Optional[str] = None, extra_config: Optional[dict] = None) -> str:
    """Write the trained draft for serving: eagle3 (SpecForge format), eagle, medusa (vLLM
    format) as a draft directory; mtp into `out_dir`, a target checkpoint directory (copied from
    `target_dir` first when `out_dir` has no config.json), as model.layers.{L}.* in mtp.safetensors
    plus num_nextn_predict_layers in its config.json. `extra_config`: merged into a draft
    directory's config.json (the CLI's "npuspec_target")."""
    if module.method != "mtp":
        return save_draft(module, out_dir, dtype=dtype, extra_config=extra_config)
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
