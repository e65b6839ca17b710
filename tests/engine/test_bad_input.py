"""Bad input to `LLM`, `generate` and `SamplingParams`, by class (issue 16): each case ends in an
error of the stated type whose message names the offending value and the fix, raised before
any work; the inputs that are fine as given are accepted and give the correct result."""
import os
import shutil

import numpy as np
import pytest
import torch

from npuspec import LLM, SamplingParams
from npuspec.engine import args as engine_args
from npuspec.models import TINY_MODEL_DIR

FAST = dict(enforce_eager=True, max_model_len=64, max_num_seqs=2)
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _raises(exc, fn, *needles):
    """fn() raises `exc` whose message contains every needle (the value, the fix)."""
    with pytest.raises(exc) as ei:
        fn()
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)
    return msg


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", **FAST)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---- generate(prompts=...) -----------------------------------------------------------------

BAD_PROMPTS = [  # (id, prompts, exception, needles: the value and the fix)
    ("none", None, TypeError, ["prompts=None", "pass a string"]),
    ("int", 5, TypeError, ["prompts=5", "pass a string"]),
    ("bytes", b"def f(", TypeError, ["b'def f('", "decode it"]),
    ("list-of-ints", [1, 2, 3], TypeError, ["[1, 2, 3]", "{'prompt_token_ids': [1, 2, 3]}"]),
    ("list-of-lists", [[1, 2, 3]], TypeError, ["prompt 0 is a list", "'prompt_token_ids'"]),
    ("ids-str", {"prompt_token_ids": "1 2 3"}, TypeError,
     ["prompt_token_ids='1 2 3'", "list of integer token ids", "string prompt"]),
    ("ids-list-of-str", {"prompt_token_ids": ["1", "2"]}, TypeError,
     ["prompt_token_ids[0]='1'", "list of integer token ids"]),
    ("ids-float", {"prompt_token_ids": [1.0]}, TypeError, ["[0]=1.0", "integer token ids"]),
    ("ids-none", {"prompt_token_ids": None}, TypeError, ["prompt_token_ids=None", "list of"]),
    ("ids-float-tensor", {"prompt_token_ids": torch.tensor([1.0, 2.0])}, TypeError,
     ["torch.float32", ".long()"]),
    ("ids-2d-tensor", {"prompt_token_ids": torch.tensor([[1, 2, 3]])}, TypeError,
     ["shape (1, 3)", "1-D", "ids[0]"]),
    ("ids-bool-array", {"prompt_token_ids": np.array([True, False])}, TypeError,
     ["dtype bool", "integer"]),
    ("ids-out-of-vocab", {"prompt_token_ids": [1, 5000]}, ValueError,
     ["token id 5000", "[0, 1024)", "this model's tokenizer"]),
    ("ids-negative", {"prompt_token_ids": [-1]}, ValueError, ["token id -1", "[0, 1024)"]),
    ("prompt-not-text", {"prompt_token_ids": [1], "prompt": 5}, TypeError,
     ["'prompt'=5", "a string"]),
    ("multimodal-key", {"prompt": "x", "multi_modal_data": {}}, ValueError,
     ["multi_modal_data", "'prompt_token_ids'"]),
    ("empty-list", [], ValueError, ["prompts is empty", "pass a string"]),
]


@pytest.mark.parametrize("prompts,exc,needles", [c[1:] for c in BAD_PROMPTS],
                         ids=[c[0] for c in BAD_PROMPTS])
def test_bad_prompts(llm, prompts, exc, needles):
    before = llm.metrics
    _raises(exc, lambda: llm.generate(prompts, GREEDY), *needles)
    assert llm.metrics is before  # raised before any work


BAD_PARAMS = [
    ("int", 5, TypeError, ["sampling_params=5", "SamplingParams(...)"]),
    ("dict", {"temperature": 0}, TypeError, ["{'temperature': 0}", "SamplingParams(...)"]),
    ("list-of-int", [1], ValueError, ["sampling_params[0] is an int", "SamplingParams(...)"]),
]


@pytest.mark.parametrize("params,exc,needles", [c[1:] for c in BAD_PARAMS],
                         ids=[c[0] for c in BAD_PARAMS])
def test_bad_sampling_params_argument(llm, params, exc, needles):
    _raises(exc, lambda: llm.generate(["def f("], params), *needles)


def test_reassigned_sampling_params_are_checked_again(llm):
    sp = SamplingParams(max_tokens=2, seed=1)
    sp.seed = 2**70  # dataclass fields can be reassigned after __post_init__ checked them
    _raises(ValueError, lambda: llm.generate(["x"], sp), "seed=1180591620717411303424",
            "2**64")


# Accepted as given: the same tokens as the plain list-of-ints form.
ACCEPTED_IDS = [
    ("tensor", lambda ids: {"prompt_token_ids": torch.tensor(ids)}),
    ("int32-tensor", lambda ids: {"prompt_token_ids": torch.tensor(ids, dtype=torch.int32)}),
    ("ndarray", lambda ids: {"prompt_token_ids": np.array(ids)}),
    ("tuple", lambda ids: {"prompt_token_ids": tuple(ids)}),
    ("numpy-ints", lambda ids: {"prompt_token_ids": [np.int64(t) for t in ids]}),
]


@pytest.mark.parametrize("make", [c[1] for c in ACCEPTED_IDS], ids=[c[0] for c in ACCEPTED_IDS])
def test_token_id_containers_accepted(llm, make):
    ids = llm.tokenizer.encode("def add(a, b):").ids
    want = _ids(llm.generate([{"prompt_token_ids": ids}], GREEDY))
    got = llm.generate([make(ids)], GREEDY)
    assert _ids(got) == want and got[0].prompt_token_ids == ids
    assert all(type(t) is int for t in got[0].prompt_token_ids)


def test_text_prompt_dict_and_generator_accepted(llm):
    want = _ids(llm.generate(["def add(a, b):", "import os"], GREEDY))
    assert _ids(llm.generate([{"prompt": "def add(a, b):"}, "import os"], GREEDY)) == want
    assert _ids(llm.generate((p for p in ["def add(a, b):", "import os"]), GREEDY)) == want


# ---- SamplingParams -------------------------------------------------------------------------

BAD_SAMPLING = [
    ("seed-2**70", {"seed": 2**70}, ValueError, ["seed=1180591620717411303424", "2**64"]),
    ("seed-float", {"seed": 1.0}, ValueError, ["seed=1.0", "integer"]),
    ("temperature-nan", {"temperature": float("nan")}, ValueError, ["temperature=nan", "finite"]),
    ("temperature-inf", {"temperature": float("inf")}, ValueError, ["temperature=inf", "finite"]),
    ("temperature-str", {"temperature": "0"}, ValueError, ["temperature='0'", "number"]),
    ("temperature-over-float32", {"temperature": 1e39}, ValueError, ["1e+39", "3.4e+38"]),
    ("top_p-nan", {"top_p": float("nan")}, ValueError, ["top_p=nan", "(0, 1]"]),
    ("top_p-rounds-to-0", {"top_p": 1e-300}, ValueError, ["top_p=1e-300", "float32"]),
    ("top_k-2**70", {"top_k": 2**70}, ValueError, ["top_k=1180591620717411303424", "-1 / 0"]),
    ("ignore_eos-str", {"ignore_eos": "yes"}, ValueError, ["ignore_eos='yes'", "True or False"]),
    ("max_tokens-float", {"max_tokens": 2.0}, ValueError, ["max_tokens=2.0", "integer >= 1"]),
    ("stop_token_ids-str", {"stop_token_ids": "1"}, ValueError, ["stop_token_ids='1'", "list"]),
    ("vllm-only-n", {"n": 2}, NotImplementedError, ["n=2", "does not implement", "remove it"]),
    ("vllm-only-stop", {"stop": ["\n"]}, NotImplementedError, ["stop=['\\n']", "remove it"]),
    ("typo", {"max_token": 3}, TypeError, ["max_token=3", "did you mean 'max_tokens'"]),
]


@pytest.mark.parametrize("kw,exc,needles", [c[1:] for c in BAD_SAMPLING],
                         ids=[c[0] for c in BAD_SAMPLING])
def test_bad_sampling_params(kw, exc, needles):
    _raises(exc, lambda: SamplingParams(**kw), *needles)


def test_our_type_errors_are_value_errors_too():
    # the CLI (and code catching ValueError around npuspec calls) maps them as user errors
    with pytest.raises(ValueError):
        SamplingParams(max_token=3)


@pytest.mark.parametrize("seed", [2**64 - 1, -2**63, 0], ids=["2**64-1", "-2**63", "0"])
def test_extreme_seeds_accepted_and_reproducible(llm, seed):
    sp = SamplingParams(temperature=1.0, max_tokens=4, seed=seed)
    a, b = llm.generate(["def f("], sp), llm.generate(["def f("], sp)
    assert _ids(a) == _ids(b) and len(a[0].outputs[0].token_ids) == 4


def test_huge_llm_seed_accepted_and_reproducible():
    sp = SamplingParams(temperature=1.0, max_tokens=6)  # unseeded: drawn from LLM(seed=...)
    a = LLM("tiny", seed=2**70, **FAST).generate(["def f("] * 2, sp)
    b = LLM("tiny", seed=2**70, **FAST).generate(["def f("] * 2, sp)
    assert _ids(a) == _ids(b)


def test_huge_max_tokens_and_top_k_accepted(llm):
    # max_model_len bounds the output; top_k at or above the vocabulary keeps every token
    out = llm.generate([{"prompt_token_ids": [1, 2]}],
                       SamplingParams(temperature=0, max_tokens=2**70, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 62
    sp = dict(temperature=1.0, max_tokens=4, seed=3)
    assert _ids(llm.generate(["x"], SamplingParams(top_k=2**62, **sp))) == \
        _ids(llm.generate(["x"], SamplingParams(**sp)))


# ---- LLM(...) -----------------------------------------------------------------------------

BAD_LLM = [
    ("spec-list", {"speculative_config": [1, 2]}, TypeError,
     ["speculative_config=[1, 2]", "pass a dict"]),
    ("spec-pairs", {"speculative_config": [("method", "ngram")]}, TypeError,
     ["is a list", "JSON string"]),
    ("spec-int", {"speculative_config": 5}, TypeError, ["speculative_config=5", "pass a dict"]),
    ("additional-list", {"additional_config": [1]}, TypeError,
     ["additional_config=[1]", "pass a dict"]),
    ("additional-unknown-key", {"additional_config": {"rejection_sampler_confg": {}}}, ValueError,
     ["rejection_sampler_confg", "did you mean 'rejection_sampler_config'"]),
    ("seed-negative", {"seed": -1}, ValueError, ["seed=-1", "integer >= 0"]),
    ("seed-float", {"seed": 1.5}, ValueError, ["seed=1.5", "integer"]),
    ("device-tpu0", {"device": "tpu0"}, ValueError, ["device='tpu0'", "'cpu'"]),
    ("device-int", {"device": 0}, ValueError, ["device=0", "string or torch.device"]),
    ("dtype-int8-torch", {"dtype": torch.int8}, ValueError, ["torch.int8", "bfloat16"]),
    ("model-int", {"model": 5}, TypeError, ["model=5", "'tiny'"]),
    ("model-missing", {"model": "/nonexistent/m"}, FileNotFoundError,
     ["/nonexistent/m", "HF checkpoint directory"]),
    # issue 34, item 5: the draft's path is named as the draft's, not as the target's
    ("draft-missing", {"speculative_config": {"method": "draft_model", "model": "/nonexistent/d",
                                              "num_speculative_tokens": 2}}, FileNotFoundError,
     ["speculative_config.model='/nonexistent/d'", "draft model path", ".gguf"]),
    ("eagle3-head-missing", {"speculative_config": {"method": "eagle3", "model": "/nonexistent/h",
                                                    "num_speculative_tokens": 2}},
     FileNotFoundError, ["speculative_config.model='/nonexistent/h'", "draft", "tiny-eagle3"]),
    ("tp-str", {"tensor_parallel_size": "1"}, ValueError, ["tensor_parallel_size='1'", "integer"]),
    ("max_model_len-float", {"max_model_len": 64.0}, ValueError, ["max_model_len=64.0", "integer"]),
    ("max_model_len-over", {"max_model_len": 10**9}, ValueError,
     ["max_model_len=1000000000", "max_position_embeddings"]),
]


@pytest.mark.parametrize("kw,exc,needles", [c[1:] for c in BAD_LLM], ids=[c[0] for c in BAD_LLM])
def test_bad_llm_args(kw, exc, needles):
    _raises(exc, lambda: LLM(**{"model": "tiny", **FAST, **kw}), *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda")])
def test_cuda_without_cuda(device):
    _raises(ValueError, lambda: LLM("tiny", device=device, **FAST), "cuda",
            "device='cpu'", "CUDA")


def test_npu_without_torch_npu():
    from npuspec.platform import _npu_available
    if _npu_available():
        pytest.skip("an NPU is present here")
    _raises(ValueError, lambda: LLM("tiny", device="npu", **FAST), "device='npu'", "torch_npu",
            "device='cpu'")


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu")])
def test_cpu_device_spellings_accepted(llm, device):
    other = LLM("tiny", device=device, **FAST)
    assert other.device.type == "cpu"
    assert _ids(other.generate(["def f("], GREEDY)) == _ids(llm.generate(["def f("], GREEDY))


# ---- resource limits: the KV pools against free memory, before any allocation ---------------

HUGE = [  # every one would ask the allocator for terabytes (or be killed for it)
    ("max_num_seqs", {"max_num_seqs": 2**40}, ["max_num_seqs (=1099511627776", "fit"]),
    ("num_kv_blocks", {"num_kv_blocks": 10**10}, ["num_kv_blocks (=10000000000", "fit"]),
    ("block_size", {"block_size": 10**9}, ["block_size (=1000000000)"]),
]


@pytest.mark.parametrize("kw,needles", [c[1:] for c in HUGE], ids=[c[0] for c in HUGE])
def test_kv_pool_larger_than_memory(kw, needles):
    msg = _raises(ValueError, lambda: LLM("tiny", **{**FAST, **kw}), "the KV cache needs",
                  "GiB", "is free on cpu", *needles)
    assert "smaller dtype" in msg


def _kv(monkeypatch, free: int, **kw):
    from npuspec.models import read_model_config
    monkeypatch.setattr("npuspec.platform.free_memory", lambda device: (free, "a test"))
    cfg = read_model_config("tiny")
    p = dict(num_blocks=1 + 2 * 5, block_size=16, max_num_seqs=2, max_model_len=64, k_max=2,
             dtype=torch.float32, device=torch.device("cpu"), num_kv_blocks=None)
    p.update(kw)
    return cfg, lambda spec=None: engine_args.check_kv_memory(cfg, spec, "tiny", **p)


def test_kv_bytes_are_exact(monkeypatch):
    cfg, check = _kv(monkeypatch, free=10**12)
    need = 11 * 16 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert check() == need
    _, check = _kv(monkeypatch, free=need - 1)
    _raises(ValueError, check, "11 blocks x 16 tokens", "a test", "max_num_seqs (=2")


def test_kv_check_counts_the_draft_model_pool(monkeypatch):
    from npuspec.config import SpeculativeConfig
    spec = SpeculativeConfig.from_dict({"method": "draft_model", "model": TINY_MODEL_DIR,
                                        "num_speculative_tokens": 2})
    cfg, check = _kv(monkeypatch, free=10**12)
    target = check()
    both = check(spec)
    # the draft (the tiny model again): its slot cache, a scratch block and a run of
    # ceil(67 / 16) = 5 blocks of 16 rows per seat
    rows = 16 * (1 + 2 * 5)
    assert both - target == 2 * cfg.num_layers * rows * cfg.num_kv_heads * cfg.head_dim * 4
    _, check = _kv(monkeypatch, free=both - 1)
    assert check() == target  # the target pool alone fits
    _raises(ValueError, lambda: check(spec), "draft_model drafter's K/V")


# ---- checkpoint and tokenizer files ---------------------------------------------------------

def _truncate(p):
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) // 2)


def _empty(p):
    open(p, "w").close()


def _flip_header(p):
    b = bytearray(open(p, "rb").read())
    b[20] ^= 0xFF  # inside the JSON header: invalid UTF-8
    open(p, "wb").write(b)


def _dir(p):
    os.remove(p)
    os.mkdir(p)


BAD_FILES = [  # (id, file, damage, what the message says is wrong)
    ("weights-truncated", "model.safetensors", _truncate, "truncated or corrupt"),
    ("weights-empty", "model.safetensors", _empty, "is empty (0 bytes)"),
    ("weights-header-flipped", "model.safetensors", _flip_header, "not a valid safetensors"),
    ("weights-a-directory", "model.safetensors", _dir, "not a regular file"),
    ("tokenizer-truncated", "tokenizer.json", _truncate, "EOF while parsing"),
    ("tokenizer-empty", "tokenizer.json", _empty, "truncated, corrupt"),
]


@pytest.mark.parametrize("name,damage,what", [c[1:] for c in BAD_FILES],
                         ids=[c[0] for c in BAD_FILES])
def test_damaged_checkpoint_names_the_file(tmp_path, name, damage, what):
    d = tmp_path / "ckpt"
    shutil.copytree(TINY_MODEL_DIR, d)
    damage(str(d / name))
    _raises(ValueError, lambda: LLM(str(d), **FAST), str(d / name), what, "re-download")
