"""The README's usage examples run as written."""
import pathlib
import re

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"<!-- readme-test -->\s*```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_tested_examples():
    assert BLOCKS, "README.md lost its <!-- readme-test --> python examples"


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i, monkeypatch):
    import npuspec.engine

    torch._dynamo.reset()
    # The LLM example compiles its step with npuspec's backend either way; the eager lowering
    # skips Inductor's C++ build, which would cost minutes on a cold CI machine and is
    # covered by tests/engine (slow) and tests/test_backend_install.py.
    monkeypatch.setattr(npuspec.engine, "DEFAULT_LOWERING", "eager")
    exec(compile(BLOCKS[i], f"README.md example {i}", "exec"), {"__name__": "readme_example"})
