"""The paged decoder and the engine against HF transformers on the random Llama / Qwen2 / Qwen3
checkpoints of test_hf_equivalence: chunked prefill over random block tables equals one HF
forward, verify steps with rollback, and engine greedy generation equals HF `generate`."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from npuspec import LLM, SamplingParams  # noqa: E402
from npuspec.models import AttnMetadata, load_model  # noqa: E402

from test_hf_equivalence import ATOL, VARIANTS, save_variant  # noqa: E402

BS = 8  # small blocks, so sequences straddle many block edges


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def saved(request, tmp_path_factory):
    return save_variant(request.param, tmp_path_factory)


def _rows(blocks, spans, T):
    """Rows (start, end) of one sequence, right-aligned in T -> ids/pos/slot index arrays."""
    pos = torch.zeros(len(spans), T, dtype=torch.long)
    slots = torch.zeros(len(spans), T, dtype=torch.long)  # padding -> scratch block 0
    for i, (s, e) in enumerate(spans):
        p = torch.arange(s, e)
        pos[i, T - (e - s):] = p
        slots[i, T - (e - s):] = blocks[p // BS] * BS + p % BS
    return pos, slots


def test_chunked_paged_prefill_and_rollback_match_hf(saved):
    hf, path = saved
    _, ours = load_model(path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (60,), generator=g)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]  # [60, V]
    cache = ours.allocate_paged_cache(num_blocks=20, block_size=BS)
    blocks = torch.randperm(19, generator=g)[:8] + 1  # a random table, never block 0
    table = blocks.int()[None].expand(3, -1).contiguous()
    # prefill 0..45 as three rows of one step (13 + 16 + 16 tokens, partial row first)
    spans = [(0, 13), (13, 29), (29, 45)]
    pos, slots = _rows(blocks, spans, 16)
    inp = ids[pos]  # padding tokens: any id (they write the scratch block)
    meta = AttnMetadata(slots, table, torch.tensor([e for _, e in spans], dtype=torch.int32))
    with torch.no_grad():
        out = ours(inp, pos, meta, cache)
    for i, (s, e) in enumerate(spans):
        torch.testing.assert_close(out[i, 16 - (e - s):], ref[s:e], atol=ATOL, rtol=1e-4)
    # a verify step of 5 tokens at 45..49 whose last 3 get rejected: the next step starts at
    # 47 and overwrites them; stale K/V past the length is never read
    for start in (45, 47):
        pos, slots = _rows(blocks, [(start, start + 5)], 5)
        wrong = ids[pos].clone()
        if start == 45:
            wrong[0, 2:] = (wrong[0, 2:] + 1) % 97  # drafts that will be "rejected"
        meta = AttnMetadata(slots, table[:1], torch.tensor([start + 5], dtype=torch.int32))
        with torch.no_grad():
            out = ours(wrong if start == 45 else ids[pos], pos, meta, cache)
        torch.testing.assert_close(out[0, :2], ref[start:start + 2], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out[0], ref[47:52], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_min": 1, "prompt_lookup_max": 2}])
def test_engine_greedy_equals_hf_generate(saved, spec):
    hf, path = saved
    prompts = [[5, 6, 7, 8, 5, 6], list(range(10, 50)), [3]]
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    llm = LLM(path, enforce_eager=True, max_model_len=128, max_num_seqs=2, block_size=BS,
              speculative_config=spec, max_num_batched_tokens=32)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in got] == want
