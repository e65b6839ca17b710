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
def test_readme_example_runs(i):
    torch._dynamo.reset()
    exec(compile(BLOCKS[i], f"README.md example {i}", "exec"), {"__name__": "readme_example"})
