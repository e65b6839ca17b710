"""The paged KV pool in the engine: preemption when blocks run out, chunked prefill under the
token budget, and the pool-size error. Greedy output must be what plain decoding with a pool
that never runs short gives."""
import pytest

from npuspec import LLM, SamplingParams
from npuspec.engine.block_manager import BlockManager, seat_blocks

from test_engine import GREEDY, PROMPTS, spec_for  # noqa: E402

LONG = [{"prompt_token_ids": [(7 * i) % 250 + 3 for i in range(150)]},
        {"prompt_token_ids": [4, 5, 6]}, {"prompt_token_ids": list(range(30, 100))}]
LONG_PARAMS = [SamplingParams(temperature=0.0, max_tokens=n) for n in (30, 60, 20)]


@pytest.fixture(scope="module")
def plain(ckpt):
    llm = LLM(ckpt, enforce_eager=True, max_model_len=256, max_num_seqs=4)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_preemption_loses_no_request_and_keeps_greedy_output(ckpt, plain, spec):
    # 4 seats but blocks for about one request at max_model_len: requests must be preempted
    # (recomputed) and re-admitted; every one finishes with the tokens plain decoding gives
    llm = LLM(ckpt, enforce_eager=True, max_model_len=128, max_num_seqs=4, block_size=16,
              num_kv_blocks=10, speculative_config=spec and spec_for(spec))
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == plain
    assert llm.metrics.num_preemptions > 0
    assert llm.runner.blocks.num_free == 9  # every block came back


def test_long_prompt_is_prefilled_in_chunks_beside_running_requests(ckpt):
    ref = LLM(ckpt, enforce_eager=True, max_model_len=256, max_num_seqs=3,
              max_num_batched_tokens=4096)
    want = [o.outputs[0].token_ids for o in ref.generate(LONG, LONG_PARAMS)]
    assert ref.metrics.num_prefill_steps == 1  # everything in one prefill forward
    # a budget of 2 rows of 32 tokens: the 150-token prompt takes several iterations, and the
    # short requests decode meanwhile
    llm = LLM(ckpt, enforce_eager=True, max_model_len=256, max_num_seqs=3,
              max_num_batched_tokens=64)
    out = llm.generate(LONG, LONG_PARAMS)
    assert [o.outputs[0].token_ids for o in out] == want
    assert llm.metrics.num_prefill_steps >= 150 // 64 + 1


def test_compiled_chunked_prefill_and_preemption(ckpt, plain):
    llm = LLM(ckpt, max_model_len=128, max_num_seqs=4, block_size=16, num_kv_blocks=10,
              max_num_batched_tokens=64, compilation_config={"backend": "eager"},
              speculative_config=spec_for("ngram"))
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == plain
    assert llm.metrics.num_preemptions > 0 and llm.metrics.num_prefill_steps > 1


def test_pool_too_small_for_one_request_names_both_numbers(ckpt):
    # one request at max_model_len=256 with 4 draft positions needs ceil(260 / 16) = 17 blocks
    with pytest.raises(ValueError, match=r"num_kv_blocks=10: the pool holds 9 blocks of 16 "
                       r"tokens.*max_model_len=256 \(\+4 draft positions\) needs 17; raise "
                       r"num_kv_blocks to at least 18"):
        LLM(ckpt, enforce_eager=True, max_model_len=256, block_size=16, num_kv_blocks=10,
            speculative_config=spec_for("ngram"))
    with pytest.raises(ValueError, match="block_size=0: must be an integer >= 1"):
        LLM(ckpt, enforce_eager=True, block_size=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens=-1"):
        LLM(ckpt, enforce_eager=True, max_num_batched_tokens=-1)


def test_default_pool_fits_every_seat_at_max_model_len(ckpt):
    llm = LLM(ckpt, enforce_eager=True, max_model_len=100, max_num_seqs=3,
              speculative_config=spec_for("ngram"))
    # ceil(100/16) = 7 blocks, plus one block of draft slack
    assert llm.block_size == 16 and llm.runner.blocks.num_free == 3 * 8


def test_seat_blocks_do_not_depend_on_k_up_to_a_block():
    # the block-table width and the pool are the same for K=0..block_size, so engines that
    # differ only in K trace the same prefill graph (Inductor's FX cache serves the second)
    assert {seat_blocks(512, k, 16) for k in range(17)} == {33}
    assert seat_blocks(512, 17, 16) == 34 and seat_blocks(500, 0, 16) == 33
    for m, k, bs in [(1, 0, 16), (100, 4, 16), (2048, 8, 128), (255, 31, 16)]:
        assert seat_blocks(m, k, bs) * bs >= m + k


def test_block_manager_grows_and_releases():
    bm = BlockManager(num_blocks=5, block_size=4)
    a, b = [], []
    assert bm.grow(a, 9) and a == [1, 2, 3]
    assert not bm.grow(b, 8) and b == []     # 2 needed, 1 free: nothing taken
    assert bm.grow(b, 4) and b == [4]
    assert bm.grow(a, 12) and len(a) == 3    # already enough
    bm.release(a)
    assert a == [] and bm.num_free == 3
