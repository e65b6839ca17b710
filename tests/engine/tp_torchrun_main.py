"""Run by tests/engine/test_tp.py under `torchrun --nproc-per-node 2`: every rank runs this
same script (the external launcher's contract) and prints its tokens as one JSON line."""
import json
import sys

from npuspec import LLM, SamplingParams

spec = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
with LLM("tiny", tensor_parallel_size=2, max_model_len=256, max_num_seqs=4,
         speculative_config=spec, compilation_config={"backend": "eager"}) as llm:
    outs = llm.generate(["def fib(n):", "The quick brown fox"],
                        SamplingParams(max_tokens=20, temperature=0))
    print(json.dumps({"rank": llm.tp.rank, "launcher": llm.tp.launcher,
                      "tokens": [o.outputs[0].token_ids for o in outs]}), flush=True)
