"""Hand-written drafter checkpoints for the tests in this folder: the tiny target's shapes, random
HF-named tensors (`Weights`), a config and a checkpoint writer, and EAGLE-3's vocabulary map."""
import json
import os

import torch
from safetensors.torch import save_file

from npuspec.models.eagle import Eagle3Draft, EagleDraft
from npuspec.models.medusa import MedusaHeads
from npuspec.models.mtp import MTPDraft

V, H, NH, NKV, D, I = 1024, 128, 4, 2, 32, 256  # the tiny target's shape; draft MLP width I
EPS, THETA, BS = 1e-5, 10000.0, 4
ATOL = 2e-4
CLASSES = {"eagle": EagleDraft, "eagle3": Eagle3Draft, "mtp": MTPDraft, "medusa": MedusaHeads}


def gen(seed):
    return torch.Generator().manual_seed(seed)


class Weights(dict):
    """Random HF-named tensors: linears ~ 1/sqrt(fan_in), norms ~ 1."""

    def __init__(self, seed=0):
        super().__init__()
        self.g = gen(seed)

    def linear(self, name, out_f, in_f, bias=False):
        self[name + ".weight"] = torch.randn(out_f, in_f, generator=self.g) / in_f ** 0.5
        if bias:
            self[name + ".bias"] = 0.1 * torch.randn(out_f, generator=self.g)

    def norm(self, name, n=H):
        self[name + ".weight"] = 1 + 0.1 * torch.randn(n, generator=self.g)

    def layer(self, p, in_dim=H, input_norm=True, hidden_norm=False, qk_norm=False, bias=False,
              inter=I):
        if input_norm:
            self.norm(p + "input_layernorm")
        if hidden_norm:
            self.norm(p + "hidden_norm")
        for proj, n in (("q", NH), ("k", NKV), ("v", NKV)):
            self.linear(f"{p}self_attn.{proj}_proj", n * D, in_dim, bias)
        self.linear(p + "self_attn.o_proj", H, NH * D)
        if qk_norm:
            self.norm(p + "self_attn.q_norm", D)
            self.norm(p + "self_attn.k_norm", D)
        self.norm(p + "post_attention_layernorm")
        self.linear(p + "mlp.gate_proj", inter, H)
        self.linear(p + "mlp.up_proj", inter, H)
        self.linear(p + "mlp.down_proj", H, inter)
        return self


def llama_cfg(**over):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
            "num_hidden_layers": 1, "num_attention_heads": NH, "num_key_value_heads": NKV,
            "head_dim": D, "intermediate_size": I, "rms_norm_eps": EPS, "rope_theta": THETA,
            "vocab_size": V, "max_position_embeddings": 2048, "hidden_act": "silu", **over}


def write(path, config, tensors, weights="model.safetensors"):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if weights.endswith(".safetensors"):
        save_file(tensors, os.path.join(path, weights))
    else:
        torch.save(tensors, os.path.join(path, weights))
    return str(path)


VD = 512


def vocab_map(seed=4):
    used = torch.randperm(V, generator=gen(seed))[:VD].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return used, used - torch.arange(VD), t2d


def eagle3_weights(n_aux=3, layers=1, qk_norm=False):
    w = Weights(2).layer("layers.0.", in_dim=2 * H, hidden_norm=True, qk_norm=qk_norm)
    for i in range(1, layers):
        w.layer(f"layers.{i}.", qk_norm=qk_norm)
    w.linear("fc", H, n_aux * H)
    w.norm("norm")
    w.linear("lm_head", VD, H)
    return w
