"""Weight-only quantized models (npuspec.models.quant): GGUF blocks read as stored, fp weights
quantized at load, and the engine running them through its captured step."""
import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from npuspec import LLM, SamplingParams  # noqa: E402
from npuspec._counters import counters  # noqa: E402
from npuspec.kernels import linear_quant_cpu as lq  # noqa: E402
from npuspec.models import load_model, quant  # noqa: E402
from npuspec.models.gguf import _unpermute_rope_rows  # noqa: E402
from test_gguf import write_llama_gguf  # noqa: E402

T = gguf.GGMLQuantizationType
ALL_Q = {"attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q8_0, "attn_output": T.Q4_0,
         "ffn_gate": T.Q4_1, "ffn_up": T.Q4_1, "ffn_down": T.Q8_0, "token_embd": T.Q8_0}


def _q4k_raw(rows, blocks, rng):
    """Random Q4_K rows (any bytes are a valid block once d and dmin are finite)."""
    raw = rng.integers(0, 256, size=(rows, blocks, 144), dtype=np.uint8)
    d = (rng.random((rows, blocks, 2)) * 0.01).astype(np.float16)
    raw[..., 0:4] = d.view(np.uint8).reshape(rows, blocks, 4)
    return raw.reshape(rows, blocks * 144)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_blocks_decode_to_what_gguf_py_dequantises(qtype):
    rng = np.random.default_rng(0)
    N, K = 6, 512
    if qtype == "Q4_K":
        raw = _q4k_raw(N, K // 256, rng)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((N, K)).astype(np.float32), getattr(T, qtype))
    q = quant.from_gguf(raw, qtype, K)
    want = gguf.quants.dequantize(raw, getattr(T, qtype)).reshape(N, K)
    assert torch.equal(q.dequantize(), torch.from_numpy(want.astype(np.float32)))
    assert q.bits == (8 if qtype == "Q8_0" else 4) and q.codes.shape == (N, K)


def test_rope_row_order_is_undone_on_quantized_rows():
    rng = np.random.default_rng(1)
    raw = gguf.quants.quantize(rng.standard_normal((64, 64)).astype(np.float32), T.Q4_1)
    q = quant.from_gguf(raw, "Q4_1", 64)
    assert torch.equal(_unpermute_rope_rows(q, 4).dequantize(),
                       torch.from_numpy(_unpermute_rope_rows(q.dequantize().numpy(), 4)))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_is_round_to_nearest_on_its_grid(scheme):
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(2))
    q = quant.quantize(w, scheme)
    err = (q.dequantize() - w).abs().view(40, 3, 32).amax(-1)
    assert (err <= q.scale * 0.5 * (1 + 1e-5) + 1e-7).all()  # half a step per group
    with pytest.raises(ValueError, match="quantization='int4': a weight with 100 input features"):
        quant.quantize(torch.randn(4, 100), "int4")


@pytest.fixture(scope="module")
def quant_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("qgguf") / "tiny-llama.quant.gguf"
    write_llama_gguf(path, tied=True, qtypes=ALL_Q)
    return str(path)


def test_as_stored_model_holds_the_file_weights_and_matches_the_dequantised_one(quant_gguf):
    _, mf = load_model(quant_gguf)
    _, mq = load_model(quant_gguf, quantization="gguf")
    for bf, bq in zip(mf.layers, mq.layers):
        for name in ("wqkv", "wo", "w13", "w2"):
            lf, lq_ = getattr(bf, name), getattr(bq, name)
            assert lq_.weight is None and lq_.quant is not None, name
            p = lq_.quant
            assert torch.equal(lq.dequantize(p.codes, p.scale, p.minv, p.bits, p.zero, p.n), lf.weight)
    assert mq.embed is None and mq.head_quant.kind == "Q8_0"
    ids = torch.tensor([[1, 5, 9, 30, 2, 7, 7, 100]])
    with torch.no_grad():
        torch.testing.assert_close(mq.forward_causal(ids)[0], mf.forward_causal(ids)[0],
                                   rtol=1e-4, atol=1e-4)
    assert quant.weight_bytes(mq) < 0.45 * quant.weight_bytes(mf)


def test_mixed_fused_parts_are_dequantised_and_counted(tmp_path):
    path = tmp_path / "mixed.gguf"
    write_llama_gguf(path, qtypes={"attn_k": T.F16})  # q Q8_0 | k F16 | v Q4_1
    before = counters.snapshot()
    _, m = load_model(str(path), quantization="gguf")
    assert counters.delta(before).get("quant_dequantised", 0) >= 2  # one per layer
    assert m.layers[0].wqkv.weight is not None and getattr(m.layers[0].wqkv, "quant", None) is None
    assert m.layers[0].wo.quant is not None


def test_bad_quantization_values_are_named(quant_gguf):
    with pytest.raises(ValueError, match="quantization.*'int3'.*'gguf', 'int8', 'int4'"):
        LLM(model=quant_gguf, quantization="int3")
    with pytest.raises(ValueError, match="quantization.*'gguf'.*not a GGUF file.*'int8' or 'int4'"):
        LLM(model="tiny", quantization="gguf")
    with pytest.raises(ValueError, match="quantization.*tensor_parallel_size"):
        LLM(model=quant_gguf, quantization="gguf", tensor_parallel_size=2)


def _greedy(llm, prompts, n=24):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


PROMPTS = [[1, 5, 9, 30, 2, 7, 7, 100, 5, 9, 30], [3, 4, 5, 3, 4, 5, 3, 4]]


def test_engine_runs_stored_weights_captured_and_speculation_is_exact(quant_gguf):
    """Greedy with ngram over the quantized weights equals plain greedy over them, in the
    captured step with no eager fallback: the K+1-row verify gives each row what the one-row
    step gives it."""
    plain = LLM(model=quant_gguf, quantization="gguf", max_num_seqs=2)
    want = _greedy(plain, PROMPTS)
    spec = LLM(model=quant_gguf, quantization="gguf", max_num_seqs=2,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                   "prompt_lookup_max": 2, "k_controller": "fixed"})
    before = counters.snapshot()
    assert _greedy(spec, PROMPTS) == want
    delta = counters.delta(before)
    assert delta.get("eager_fallbacks", 0) == 0 and delta.get("graph_replays", 0) > 0
    assert spec.metrics.num_accepted > 0


def test_int8_quantizes_an_hf_checkpoint_at_load():
    _, m = load_model("tiny", quantization="int8")
    assert all(getattr(b, n).quant.bits == 8 for b in m.layers for n in ("wqkv", "wo", "w13", "w2"))
    _, mf = load_model("tiny")
    ids = torch.tensor([[1, 50, 90, 300, 2]])
    with torch.no_grad():
        a, b = m.forward_causal(ids)[0], mf.forward_causal(ids)[0]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


def test_the_cli_flag_offers_exactly_the_engine_values():
    import argparse

    from npuspec.cli_util.flags import add_quantization_flag
    p = argparse.ArgumentParser()
    add_quantization_flag(p)
    action = next(a for a in p._actions if a.dest == "quantization")
    assert tuple(action.choices) == quant.QUANTIZATIONS
