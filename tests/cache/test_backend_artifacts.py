"""Through the real backend: the entry keeps npuspec's own JSON artifacts (capture plan,
dynamic-K table, pattern matches, verify kernel config), and a second compile hits."""
import json
import os

import torch

from npuspec import counters
from npuspec.graphs.cache import CacheDir


def step(logits, drafts):
    target = logits.argmax(-1)                                        # [B, K+1]
    return (target[:, :-1] == drafts).int().cumprod(-1).sum(-1)       # [B]


def test_backend_records_json_artifacts_and_hits(tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 8, 1]]}
    opts = {"cache_dir": str(tmp_path), "lowering": "eager", "speculative_config": spec,
            "max_num_seqs": 4}
    logits, drafts = torch.randn(2, 4, 16), torch.randint(0, 16, (2, 3))
    torch._dynamo.reset()
    before = counters.snapshot()
    out = torch.compile(step, backend="npuspec", options=opts)(logits, drafts)
    assert torch.equal(out, step(logits, drafts))
    assert counters.delta(before).get("cache_misses") == 1
    (key,) = CacheDir(str(tmp_path)).keys()
    jdir = os.path.join(str(tmp_path), "entries", key, "json")
    names = sorted(os.listdir(jdir))
    assert {"capture_plan.json", "dynamic_k.json", "pattern_matches.json",
            "verify_kernel.json"} <= set(names), names
    plan = json.load(open(os.path.join(jdir, "capture_plan.json")))
    assert plan["max_num_seqs"] == 4
    assert plan["sizes_per_k"]["3"] == [4, 8, 16] and plan["sizes_per_k"]["1"] == [2, 4, 8]
    assert json.load(open(os.path.join(jdir, "verify_kernel.json")))["impl"] in (
        "cpu", "reference", "triton")
    torch._dynamo.reset()
    before = counters.snapshot()
    out = torch.compile(step, backend="npuspec", options=opts)(logits, drafts)
    assert torch.equal(out, step(logits, drafts))
    assert counters.delta(before).get("cache_hits") == 1
