"""The `LLM` example of docs/engine.md (pasted into the README) runs as written."""
import os
import re

import pytest

import npuspec.engine
from npuspec.models import TINY_MODEL_DIR

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "engine.md")


def snippet() -> str:
    with open(DOC) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert blocks, "docs/engine.md has no ```python block"
    return blocks[0]


def run_snippet(code: str, capsys):
    ns: dict = {}
    exec(compile(code, "docs/engine.md", "exec"), ns)
    out = capsys.readouterr().out
    assert out.count("->") == 3 and "tokens/s:" in out
    llm = ns["llm"]
    assert all(len(o.outputs[0].token_ids) == 32 or o.outputs[0].finish_reason == "stop"
               for o in ns["outputs"])
    assert llm.metrics.num_drafted > 0
    return ns


def _code(ckpt):
    code = snippet()
    assert 'model="tiny"' in code
    if not os.path.isfile(os.path.join(TINY_MODEL_DIR, "config.json")):
        code = code.replace('model="tiny"', f"model={ckpt!r}")  # the tiny model is not built yet
    return code


def test_docs_example_runs(ckpt, capsys, monkeypatch):
    # the snippet exactly, with Dynamo + the npuspec backend + capture, but the "eager"
    # lowering instead of Inductor's C++ codegen to fit the CI budget (the slow test below
    # runs it unchanged)
    monkeypatch.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")
    run_snippet(_code(ckpt), capsys)


@pytest.mark.slow
def test_docs_example_runs_unchanged(ckpt, capsys):
    run_snippet(_code(ckpt), capsys)
