"""The offline engine (issue 7): greedy identity, seeded sampling, continuous batching, stops,
metrics and bad-input errors. These run uncompiled (enforce_eager=True); test_compiled.py runs
the same checks through torch.compile(backend="npuspec") with graph capture."""
import time

import pytest

from npuspec import LLM, SamplingParams

# mixed prompt lengths and budgets; with max_num_seqs=2 the later prompts wait for free slots
PROMPTS = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [11] * 40},
           {"prompt_token_ids": list(range(20, 50))}, {"prompt_token_ids": [3]},
           {"prompt_token_ids": [9, 8, 7, 9, 8, 7, 9, 8]}]
MAX_TOKENS = [40, 25, 33, 48, 17]
GREEDY = [SamplingParams(temperature=0.0, max_tokens=n) for n in MAX_TOKENS]


def spec_for(method, draft_ckpt=None, dynamic=False):
    if method == "ngram":
        s = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
    elif method == "suffix":
        s = {"method": "suffix", "num_speculative_tokens": 6}
    else:
        s = {"method": "draft_model", "num_speculative_tokens": 3, "model": draft_ckpt}
    if dynamic and method != "suffix":  # suffix picks its own length; the table is refused
        s["num_speculative_tokens_per_batch_size"] = [[1, 1, s["num_speculative_tokens"]],
                                                       [2, 8, 2]]
    if dynamic and method == "draft_model":
        s["dynamic_spec_config"] = {"method": "draft_model", "method_params": {
            "initial_verify_budget_per_req": 2, "budget_update_interval": 3,
            "budget_threshold": 0.5, "min_verify_tokens": 1}}
    return s


@pytest.fixture(scope="module")
def plain(ckpt):
    llm = LLM(ckpt, enforce_eager=True, max_model_len=128, max_num_seqs=2)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_plain_greedy_never_stops_early_without_eos(plain):
    # the checkpoint's config has no eos_token_id: every request runs to max_tokens
    assert [len(t) for t in plain] == MAX_TOKENS


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixedK", "dynamicK"])
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "self_draft"])
def test_greedy_speculative_equals_plain(ckpt, draft_ckpt, plain, method, dynamic):
    if method == "suffix" and dynamic:
        pytest.skip("suffix decoding sizes its drafts itself (the batch table is refused)")
    d = ckpt if method == "self_draft" else draft_ckpt
    llm = LLM(ckpt, enforce_eager=True, max_model_len=128, max_num_seqs=2,
              speculative_config=spec_for(method.replace("self_draft", "draft_model"), d, dynamic))
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == plain
    m = llm.metrics
    assert m.num_drafted > 0
    if method in ("ngram", "suffix", "self_draft"):
        assert m.num_accepted > 0  # the random model's loops are easy to predict
    if method == "self_draft" and not dynamic:
        assert m.num_accepted == m.num_drafted  # the target drafting for itself: all accepted
    if dynamic and method != "suffix":
        assert set(m.steps_by_k) == {2, spec_for(method.replace("self_draft", "draft_model"), d)
                                     ["num_speculative_tokens"]}


def test_continuous_batching_fills_freed_slots(ckpt):
    llm = LLM(ckpt, enforce_eager=True, max_model_len=128, max_num_seqs=2)
    out = llm.generate(PROMPTS, GREEDY)
    m = llm.metrics
    # 5 requests through 2 slots: total engine steps is less than running them one by one
    assert m.num_engine_steps < sum(MAX_TOKENS)
    assert m.num_engine_steps >= max(MAX_TOKENS)
    assert sum(o.metrics.num_steps for o in out) == sum(MAX_TOKENS)


def sample_params():
    return [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7, max_tokens=30),
            SamplingParams(temperature=0.0, max_tokens=12),
            SamplingParams(temperature=1.0, max_tokens=20),
            SamplingParams(temperature=1.3, top_k=5, seed=123, max_tokens=25)]


@pytest.mark.parametrize("method", [None, "ngram", "draft_model"])
def test_seeded_sampling_reproducible_and_batch_independent(ckpt, draft_ckpt, method):
    spec = None if method is None else spec_for(method, draft_ckpt)
    llm = LLM(ckpt, enforce_eager=True, max_model_len=128, max_num_seqs=3, speculative_config=spec)
    sp = sample_params()
    prompts = PROMPTS[:4]
    alone = llm.generate(prompts[0], sp[0])[0].outputs[0].token_ids
    again = llm.generate(prompts[0], sp[0])[0].outputs[0].token_ids
    batch = llm.generate(prompts, sp)
    assert alone == again
    assert batch[0].outputs[0].token_ids == alone
    last = llm.generate(prompts[3], sp[3])[0].outputs[0].token_ids
    assert batch[3].outputs[0].token_ids == last
    assert len(alone) == 30
    # unseeded requests follow LLM(seed=...): a fresh engine with the same seed repeats them
    llm2 = LLM(ckpt, enforce_eager=True, max_model_len=128, max_num_seqs=3, speculative_config=spec)
    b2 = llm2.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in b2] == [o.outputs[0].token_ids for o in batch]


def test_sampling_differs_from_greedy_and_between_seeds(ckpt):
    llm = LLM(ckpt, enforce_eager=True, max_model_len=128)
    p = PROMPTS[2]
    a = llm.generate(p, SamplingParams(temperature=1.0, seed=1, max_tokens=30))[0].outputs[0]
    b = llm.generate(p, SamplingParams(temperature=1.0, seed=2, max_tokens=30))[0].outputs[0]
    g = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0]
    assert a.token_ids != b.token_ids and a.token_ids != g.token_ids


@pytest.mark.parametrize("method", [None, "ngram"])
def test_stop_tokens_and_length_limits(ckpt, plain, method):
    spec = None if method is None else spec_for(method)
    llm = LLM(ckpt, enforce_eager=True, max_model_len=64, max_num_seqs=2, speculative_config=spec)
    ref = plain[0]
    stop = ref[10]
    first = ref.index(stop)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40,
                                                  stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop"
    # prompt of 60 tokens, max_model_len 64: 4 tokens fit, whatever max_tokens says
    out = llm.generate({"prompt_token_ids": [7] * 60}, SamplingParams(temperature=0, max_tokens=30))
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].finish_reason == "length"


def test_eos_stops_unless_ignored(ckpt, plain, make_ckpt, tmp_path):
    # the same weights as `ckpt` (same seed and shapes), with eos = a token greedy emits
    eos = plain[0][12]
    path = make_ckpt(tmp_path / "eos", eos=eos)
    llm = LLM(path, enforce_eager=True, max_model_len=128, speculative_config=spec_for("ngram"))
    out = llm.generate(PROMPTS[0], GREEDY[0])[0].outputs[0]
    assert out.token_ids == plain[0][:plain[0].index(eos) + 1] and out.finish_reason == "stop"
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[0], ignore_eos=True)
    out = llm.generate(PROMPTS[0], sp)[0].outputs[0]
    assert out.token_ids == plain[0] and out.finish_reason == "length"


def test_string_prompts_and_text(ckpt):
    llm = LLM(ckpt, enforce_eager=True, max_model_len=128,
              speculative_config=spec_for("ngram"))
    out = llm.generate(["def add(a, b):", "import os"], SamplingParams(temperature=0, max_tokens=8))
    assert out[0].prompt == "def add(a, b):"
    assert out[0].prompt_token_ids == llm.tokenizer.encode("def add(a, b):").ids
    o = out[0].outputs[0]
    assert len(o.token_ids) == 8
    assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)


def test_metrics_sanity(ckpt):
    llm = LLM(ckpt, enforce_eager=True, max_model_len=128, max_num_seqs=2,
              speculative_config=spec_for("ngram"))
    out = llm.generate(PROMPTS, GREEDY)
    m = llm.metrics
    for o, n in zip(out, MAX_TOKENS):
        r = o.metrics
        assert r.num_output_tokens == len(o.outputs[0].token_ids) == n
        assert 0 <= r.num_accepted <= r.num_drafted
        assert r.num_steps + r.num_accepted >= n  # every step emits accepted + 1 (last cut)
        assert r.mean_acceptance_length == pytest.approx((r.num_steps + r.num_accepted) / r.num_steps)
        assert sum(r.accepted_by_position) == r.num_accepted
        assert sum(r.drafted_by_position) == r.num_drafted
        acc = r.accepted_by_position
        assert all(a >= b for a, b in zip(acc, acc[1:]))  # a prefix is accepted
        assert r.tokens_per_s > 0 and r.step_s > 0 and r.draft_s >= 0 and r.bookkeeping_s > 0
        assert r.prefill_s >= 0 and r.total_s >= r.step_s * 0  # times are non-negative
        assert all(p is None or 0 <= p <= 1 for p in r.acceptance_by_position)
    assert m.num_output_tokens == sum(MAX_TOKENS)
    assert m.num_accepted == sum(o.metrics.num_accepted for o in out)
    assert m.num_drafted == sum(o.metrics.num_drafted for o in out)
    assert m.num_engine_steps == sum(m.steps_by_k.values())
    assert m.num_steps == sum(o.metrics.num_steps for o in out) > m.num_engine_steps
    assert sum(m.accepted_by_position) == m.num_accepted
    # every request-step emits accepted + 1 tokens; only a request's last step may be cut
    assert m.mean_acceptance_length * m.num_steps >= sum(MAX_TOKENS)
    assert m.mean_acceptance_length == pytest.approx((m.num_steps + m.num_accepted) / m.num_steps)
    assert m.draft_s + m.step_s + m.bookkeeping_s + m.prefill_s <= m.total_s * 1.01
    assert m.tokens_per_s == pytest.approx(m.num_output_tokens / m.total_s)


# ---- bad input: a clear error, raised before any work ------------------------------------------

@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, enforce_eager=True, max_model_len=32)


@pytest.mark.parametrize("prompt,match", [
    ("", "prompt 0 is empty"),
    ({"prompt_token_ids": []}, "prompt 0 is empty"),
    ({"prompt_token_ids": [1, 300]}, r"token id 300 at index 1.*\[0, 300\)"),
    ({"prompt_token_ids": [1, -2]}, r"token id -2"),
    ({"prompt_token_ids": [1] * 32}, r"32 tokens but max_model_len=32"),
    ({"tokens": [1]}, "prompt_token_ids"),
    (3.5, "pass a string"),
])
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=2))


def test_bad_prompt_fails_before_any_work(llm):
    steps_before = llm.metrics
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [400]}])
    assert llm.metrics is steps_before  # nothing ran


@pytest.mark.parametrize("kw,match", [
    ({"max_tokens": 0}, "max_tokens=0"), ({"max_tokens": -3}, "max_tokens=-3"),
    ({"temperature": -1.0}, "temperature=-1.0"), ({"top_p": 0.0}, "top_p=0.0"),
    ({"top_k": -2}, "top_k=-2"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["x"], [SamplingParams(), SamplingParams()])


def test_string_prompt_without_tokenizer(draft_ckpt):
    llm = LLM(draft_ckpt, enforce_eager=True, max_model_len=32)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        llm.generate("hello")


@pytest.mark.parametrize("kw,exc,match", [
    ({"tensor_parallel_size": 3}, ValueError, "num_attention_heads=4 is not divisible"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, ValueError,
     "num_speculative_tokens"),
    ({"compilation_config": {"cudagraph_capture_size": [4]}}, ValueError,
     "did you mean 'cudagraph_capture_sizes'"),
    ({"compilation_config": {"cudagraph_mode": "SOMETIMES"}}, ValueError, "cudagraph_mode"),
    ({"max_model_len": 4096}, ValueError, "max_position_embeddings"),
    ({"max_num_seqs": 0}, ValueError, "max_num_seqs=0"),
    ({"dtype": "int8"}, ValueError, "dtype='int8'"),
    ({"additional_config": {"rejection_sampler_config": {"enable_block_verify": True}}},
     ValueError, "needs a speculative_config"),
])
def test_bad_engine_args(ckpt, kw, exc, match):
    with pytest.raises(exc, match=match):
        LLM(ckpt, enforce_eager=True, **kw)


def test_draft_vocab_mismatch(ckpt, tmp_path, make_ckpt):
    other = make_ckpt(tmp_path / "v", vocab_size=256, hidden=32, layers=1, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match=r"vocab_size \(256\) differs from the target's \(300\)"):
        LLM(ckpt, enforce_eager=True, speculative_config={
            "method": "draft_model", "num_speculative_tokens": 2, "model": other})


def test_additional_config_block_verify_runs(ckpt, plain):
    # vLLM Ascend's additional_config keys reach the verify op; greedy is unaffected
    llm = LLM(ckpt, enforce_eager=True, max_model_len=128, max_num_seqs=2,
              speculative_config=spec_for("ngram"),
              additional_config={"rejection_sampler_config": {"enable_block_verify": True}})
    assert llm.runner.step_module.block_verify
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == plain
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.7, seed=3, max_tokens=10))
    assert all(len(o.outputs[0].token_ids) == 10 for o in out)


def test_json_speculative_config_and_synthetic_acceptance(ckpt, plain):
    # a JSON string as `vllm serve --speculative-config` takes it; synthetic rates of 0 reject
    # every draft whatever the target says, so the output is plain greedy decoding
    import json
    spec = dict(spec_for("ngram"), rejection_sample_method="synthetic",
                synthetic_acceptance_rates=[0.0, 0.0, 0.0, 0.0])
    llm = LLM(ckpt, enforce_eager=True, max_model_len=128, speculative_config=json.dumps(spec))
    out = llm.generate(PROMPTS[4], GREEDY[4])
    assert llm.metrics.num_drafted > 0 and llm.metrics.num_accepted == 0
    assert out[0].outputs[0].token_ids == plain[4]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_proposer_sees_every_emitted_token(ckpt, method):
    """The drafter gets each verify step's kept tokens, the finishing step's too (issue 34,
    item 3: the suffix cache missed up to K+1 tokens of every response), through
    `extend_batch`, the engine's one call per step."""
    llm = LLM(ckpt, enforce_eager=True, max_model_len=128, max_num_seqs=2,
              speculative_config=spec_for(method))
    seen, stopped = {}, []
    real_extend, real_stop = llm.proposer.extend_batch, llm.proposer.stop_request

    def extend_batch(req_ids, tokens):
        for req_id, toks in zip(req_ids, tokens):
            seen.setdefault(req_id, []).extend(toks)
        real_extend(req_ids, tokens)

    def stop(req_id):
        stopped.append((req_id, list(seen.get(req_id, []))))
        real_stop(req_id)

    llm.proposer.extend_batch, llm.proposer.stop_request = extend_batch, stop
    out = llm.generate(PROMPTS, GREEDY)
    assert len(stopped) == len(PROMPTS)
    by_id = dict(stopped)
    for o in out:  # the prefill's token, then each verify step's, up to the last
        assert by_id[o.request_id] == o.outputs[0].token_ids, o.request_id


def test_a_hidden_state_drafters_first_pass_is_charged_to_drafting(monkeypatch):
    """draft_s is the drafter's whole share of a round: the first pass it runs on each verify
    step's features counts as drafting, not as the engine's bookkeeping."""
    llm = LLM("tiny", speculative_config={"method": "eagle3", "model": "tiny-eagle3",
                                          "num_speculative_tokens": 2},
              enforce_eager=True, max_model_len=128, max_num_seqs=2)
    real = llm.proposer.on_verify

    def slow(*a):
        time.sleep(0.02)
        return real(*a)
    monkeypatch.setattr(llm.proposer, "on_verify", slow)
    out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=6))
    m = llm.metrics
    assert out[0].metrics.num_steps == m.num_engine_steps > 0
    assert m.draft_s >= 0.02 * m.num_engine_steps
    assert m.bookkeeping_s < 0.02 * m.num_engine_steps
