"""`CompiledBySignature`: one compiled function per input signature, called without Dynamo's
guards; every call equals eager, a new K or a None-vs-tensor input compiles anew, a new row
count does not."""
import torch

from npuspec.compilation.compiled import CompiledBySignature, signature
from npuspec.graphs import mark_token_dim

OPTS = {"lowering": "eager", "capture": False}


def step(x, w, t=None):
    # x [B, K+1, H], w [H, H], t [B] or None
    y = (x @ w).softmax(-1).argmax(-1)                            # [B, K+1]
    return y if t is None else y + (t > 0)[:, None].long()


def _inputs(B, K, H=8, seed=0, with_t=False):
    g = torch.Generator().manual_seed(seed)
    x = mark_token_dim(torch.randn(B, K + 1, H, generator=g), 0)
    t = mark_token_dim(torch.rand(B, generator=g) - 0.5, 0) if with_t else None
    return x, t


def test_one_function_per_signature_and_eager_results():
    w = torch.randn(8, 8)
    # one plain function for every signature: each compiled copy must get a code object of
    # its own, or without guards the first signature's graph would serve the others
    c = CompiledBySignature(step, OPTS)
    for B, K, with_t in [(1, 4, False), (5, 4, False), (3, 4, False), (2, 2, False),
                         (7, 2, False), (3, 4, True), (1, 4, True), (4, 4, False)]:
        x, t = _inputs(B, K, seed=B * 10 + K, with_t=with_t)
        got = c(x, w, t)
        assert torch.equal(got, step(x, w, t)), (B, K, with_t)
    # K = 4, K = 2, and K = 4 with a temperature: three functions, whatever the row counts
    assert len(c.fns) == 3
    assert len({id(f._torchdynamo_orig_callable.__code__) for f in c.fns.values()}) == 3


def test_the_key_reads_only_what_may_change_a_graph():
    x1, _ = _inputs(1, 4)
    x5, _ = _inputs(5, 4)
    w = torch.randn(8, 8)
    assert signature((x1, w), {}) == signature((x5, w), {})          # rows: marked, dynamic
    assert signature((x1, w), {}) != signature((_inputs(1, 3)[0], w), {})      # K
    assert signature((x1, w), {}) != signature((x1, w.double()), {})           # dtype
    assert signature((x1, w), {}) != signature((x1, w.t()), {})                # strides
    assert signature((x1, w), {"t": None}) != signature((x1, w), {"t": torch.ones(1)})
    unmarked = torch.randn(3)
    assert signature((unmarked,), {}) != signature((torch.randn(4),), {})     # an unmarked dim 0
    with torch.inference_mode():
        inside = signature((x1, w), {})
    assert inside != signature((x1, w), {})                                   # inference mode



def test_an_engine_s_compiled_steps_do_not_outlive_it(monkeypatch):
    """Dynamo installs each compiled graph's function in the frame's globals, and its guards
    keep those globals alive: the step copies' globals are their own and are emptied when
    their CompiledBySignature goes, so the engine's KV pool (and weights) go with the engine.
    Without the emptying they stay for the life of the process."""
    import gc
    import weakref

    from npuspec.compilation import compiled
    from npuspec.engine import LLM, SamplingParams
    for drop, freed in ((compiled.drop_compiled, True), (lambda dicts: None, False)):
        monkeypatch.setattr(compiled, "drop_compiled", drop)
        llm = LLM("tiny", max_num_seqs=2, max_model_len=64)
        llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=4))
        kv = weakref.ref(llm.runner.cache.k)
        del llm
        gc.collect()
        assert (kv() is None) == freed, drop
