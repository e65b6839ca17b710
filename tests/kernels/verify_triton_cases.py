"""Run the Triton verify kernel on a few awkward cases and compare with the reference and the
fused CPU lowering (torch.equal). Meant to run with TRITON_INTERPRET=1 (on CPU) or on a GPU;
exits non-zero on the first mismatch. Used by test_rejection_sample.py in a subprocess, because
TRITON_INTERPRET must be set before triton is imported."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_rejection_sample import MODES, make_case, mode_kwargs  # noqa: E402

from npuspec.kernels.verify import rejection_sample_reference  # noqa: E402

# (B, K, V, modes): V not a power of two, K from 1 to 15, rows wider than a vocab block. The
# interpreter costs ~50 ms per row and pass, so the long-K and wide-V cases run a few modes.
CASES = [(3, 1, 7, MODES), (4, 3, 1000, MODES), (2, 15, 7, ["standard", "block_q", "synthetic"]),
         (2, 2, 32000, ["standard", "block_q"]), (1, 7, 5003, ["entropy_block", "topk_topp"])]


def main(device: str = "cpu") -> int:
    n = 0
    for ci, (B, K, V, modes) in enumerate(CASES):
        for mi, mode in enumerate(modes):
            seed = 100 * ci + mi
            logits, x, q, t, u, e = make_case(B, K, V, seed, draft_probs=True,
                                              dtype=torch.bfloat16 if mi % 3 == 0 else torch.float32)
            kw, qq = mode_kwargs(mode, K, t, q, B, V, torch.Generator().manual_seed(seed))
            args = dict(uniforms=u, exponentials=e, **kw)
            ref = rejection_sample_reference(logits, x, qq, **args)
            dev = lambda a: a.to(device) if isinstance(a, torch.Tensor) else a  # noqa: E731
            tri = rejection_sample_reference(dev(logits), dev(x), dev(qq), impl="triton",
                                             **{k: dev(v) for k, v in args.items()})
            outs = [("triton", tri)]
            if device == "cpu":
                outs.append(("cpu", rejection_sample_reference(logits, x, qq, impl="cpu", **args)))
            for name, o in outs:
                if not all(torch.equal(a, b.cpu()) for a, b in zip(ref, o)):
                    print(f"MISMATCH {name} B={B} K={K} V={V} mode={mode}\nref={ref}\n{name}={o}")
                    return 1
            n += 1
    n += hypothesis_cases(device)
    n += ramp_cases(device)
    print(f"all equal: {n} cases")
    return 0


def compare(B, K, V, mode, seed, device, bf16=False) -> None:
    logits, x, q, t, u, e = make_case(B, K, V, seed, draft_probs=True,
                                      dtype=torch.bfloat16 if bf16 else torch.float32)
    kw, qq = mode_kwargs(mode, K, t, q, B, V, torch.Generator().manual_seed(seed))
    args = dict(uniforms=u, exponentials=e, **kw)
    ref = rejection_sample_reference(logits, x, qq, **args)
    dev = lambda a: a.to(device) if isinstance(a, torch.Tensor) else a  # noqa: E731
    tri = rejection_sample_reference(dev(logits), dev(x), dev(qq), impl="triton",
                                     **{k: dev(v) for k, v in args.items()})
    assert all(torch.equal(a, b.cpu()) for a, b in zip(ref, tri)), (B, K, V, mode, ref, tri)


def ramp_cases(device: str) -> int:
    """Logits rising along the vocab: the running max grows in every block, so the online
    softmax rescales S, e[x], the races and the entropy sum at every step."""
    n = 0
    for mode in ("standard", "standard_q", "entropy"):
        logits, x, q, t, u, e = make_case(2, 2, 20000, 7, draft_probs=True, greedy_frac=0.0)
        logits = logits * 0.1 + torch.linspace(-30.0, 5.0, 20000)
        x[:, 0] = 19999                      # drafts near the top of the ramp get accepted
        kw, qq = mode_kwargs(mode, 2, t, q, 2, 20000, torch.Generator().manual_seed(n))
        args = dict(uniforms=u, exponentials=e, **kw)
        ref = rejection_sample_reference(logits, x, qq, **args)
        dev = lambda a: a.to(device) if isinstance(a, torch.Tensor) else a  # noqa: E731
        tri = rejection_sample_reference(dev(logits), dev(x), dev(qq), impl="triton",
                                         **{k: dev(v) for k, v in args.items()})
        assert all(torch.equal(a, b.cpu()) for a, b in zip(ref, tri)), (mode, ref, tri)
        n += 1
    return n


def hypothesis_cases(device: str) -> int:
    """A few hypothesis-drawn shapes/modes (rows capped: the interpreter is slow)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    seen = []

    @settings(max_examples=5, deadline=None, derandomize=True, database=None)
    @given(B=st.integers(1, 257), K=st.integers(1, 15), V=st.sampled_from([7, 1000, 32000]),
           mode=st.sampled_from(MODES), seed=st.integers(0, 2 ** 16), bf16=st.booleans())
    def prop(B, K, V, mode, seed, bf16):
        rows = 24 if V < 32000 else 6
        B = max(1, min(B, rows // (K + 1)))
        compare(B, K, V, mode, seed, device, bf16)
        seen.append((B, K, V, mode))

    prop()
    return len(seen)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
