"""npuspec's decoder against HF transformers on random-initialised Llama / Qwen2 / Qwen3
checkpoints saved with save_pretrained: prefill, batched multi-slot decode, speculative
chunks with rollback, and padding rows."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from npuspec.models import load_model  # noqa: E402

ATOL = 2e-5
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=97, max_position_embeddings=256)
VARIANTS = {
    # GQA + biases on q/k/v/o
    "llama": lambda: transformers.LlamaConfig(**SMALL, attention_bias=True),
    "llama_tied_mha": lambda: transformers.LlamaConfig(**{**SMALL, "num_key_value_heads": 4},
                                                      tie_word_embeddings=True, rope_theta=500.0),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),  # q/k/v biases always on
    # q/k norm, head_dim not hidden/heads, GQA 4:1
    "qwen3": lambda: transformers.Qwen3Config(**{**SMALL, "num_key_value_heads": 1}, head_dim=24),
}


def save_variant(name, tmp_path_factory):
    """A random HF model of VARIANTS[name], saved; -> (hf_model, its directory)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(VARIANTS[name]()).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb them so they matter
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.2)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return hf, str(path)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    """(hf_model, npuspec_model) sharing one saved checkpoint."""
    hf, path = save_variant(request.param, tmp_path_factory)
    cfg, ours = load_model(path)
    assert cfg.model_type == hf.config.model_type
    return hf, ours


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


def step(model, cache, rows):
    """rows: list of (slot, start_pos, tokens), all with the same len(tokens)."""
    ids = torch.tensor([t for _, _, t in rows])
    pos = torch.tensor([[p + j for j in range(len(t))] for _, p, t in rows])
    slots = torch.tensor([s for s, _, _ in rows])
    with torch.no_grad():
        return model(ids, pos, slots, cache)


def test_prefill_matches(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = ours.allocate_cache(num_slots=2, max_len=64)
    out = step(ours, cache, [(1, 0, ids)])
    assert out.dtype == torch.float32 and out.shape == (1, 40, 97)
    torch.testing.assert_close(out[0], hf_logits(hf, ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.forward_causal(torch.tensor([ids]))[0], hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_multi_slot_decode_with_rollback(pair):
    hf, ours = pair
    g = torch.Generator().manual_seed(2)
    rand = lambda n: torch.randint(0, 97, (n,), generator=g).tolist()  # noqa: E731
    cache = ours.allocate_cache(num_slots=4, max_len=48)  # slot 3 = scratch for padding rows
    seqs = {0: rand(5), 1: rand(17), 2: rand(9)}  # different lengths -> different positions
    for slot, ids in seqs.items():  # prefill, one request at a time
        out = step(ours, cache, [(slot, 0, ids)])
        torch.testing.assert_close(out[0], hf_logits(hf, ids), atol=ATOL, rtol=0)

    for it in range(4):
        # speculative verify step: every request scores 3 new tokens (T = K + 1 = 3)
        new = {s: rand(3) for s in seqs}
        rows = [(s, len(seqs[s]), new[s]) for s in seqs] + [(3, 0, [0, 0, 0])]  # + padding row
        out = step(ours, cache, rows)
        for b, s in enumerate(seqs):
            ref = hf_logits(hf, seqs[s] + new[s])[-3:]
            torch.testing.assert_close(out[b], ref, atol=ATOL, rtol=0, msg=f"step {it} slot {s}")
        # reject some: keep a request-dependent prefix; the stale K/V past it stays in the
        # cache and must be ignored (and later overwritten) without any copy
        for s in seqs:
            seqs[s] = seqs[s] + new[s][: (s + it) % 4]

    # single-token decode steps in a different row order after the rollbacks
    for it in range(3):
        order = [2, 0, 1]
        new = {s: rand(1) for s in order}
        out = step(ours, cache, [(s, len(seqs[s]), new[s]) for s in order])
        for b, s in enumerate(order):
            seqs[s] = seqs[s] + new[s]
            torch.testing.assert_close(out[b, 0], hf_logits(hf, seqs[s])[-1], atol=ATOL, rtol=0)
