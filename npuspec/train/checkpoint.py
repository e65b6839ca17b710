"""Resumable training checkpoints (`state_dir`): weights, AdamW state and both RNG states in one
safetensors file plus a JSON; no pickles. Resuming reproduces the uninterrupted run bit for
bit."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from npuspec.train.config import TrainConfig

STATE_FORMAT = 1


def _gen_state_tensor(state: torch.Tensor) -> torch.Tensor:
    return state.clone().to(torch.uint8)


def save_state(state_dir: str, module, opt, gen: torch.Generator, step: int, cfg: TrainConfig,
               history: dict, extra: dict) -> None:
    """Write state_dir/{state.safetensors, state.json} atomically (a temp dir renamed over)."""
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


def restore(meta, tensors, module, opt, gen, cfg: TrainConfig, data_info: dict):
    old = meta["config"]
    diff = [f"{k}: {old.get(k)!r} -> {getattr(cfg, k)!r}" for k in TrainConfig.TRAJECTORY
            if old.get(k) != getattr(cfg, k)]
    if diff:
        raise ValueError("--resume: the checkpoint was written with other settings ("
                         + "; ".join(diff) + "); rerun with the same ones, or train afresh "
                         "without --resume")
    if meta.get("data") != data_key(data_info):
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


def data_key(info: dict) -> dict:
    return {k: info.get(k) for k in ("source", "dir", "root", "train_files", "val_files",
                                     "train_tokens")}
