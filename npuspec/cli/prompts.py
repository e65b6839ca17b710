"""The code prompts `npuspec demo`, `bench e2e` and `tune` use by default.

Speculative decoding pays off when the continuation repeats what is already in the context
(editing code, filling in a pattern), which is what prompt lookup (ngram) drafts from. These
prompts are short Python fragments in the style of the standard library the embedded model was
trained on, each with a pattern to continue.
"""
from __future__ import annotations

import json
import os

from npuspec.cli.errors import UsageError

DEMO_PROMPTS = [
    # a class whose methods follow one pattern
    "class Point:\n"
    "    def __init__(self, x, y):\n"
    "        self.x = x\n"
    "        self.y = y\n"
    "\n"
    "    def __repr__(self):\n"
    "        return f'Point({self.x!r}, {self.y!r})'\n"
    "\n"
    "    def __eq__(self, other):\n",
    # argument checks, one per parameter
    "def check(name, value, lo, hi):\n"
    "    if not isinstance(name, str):\n"
    "        raise TypeError('name must be a str')\n"
    "    if not isinstance(value, int):\n"
    "        raise TypeError('value must be an int')\n"
    "    if not isinstance(lo, int):\n",
    # an import block and a function over os.path
    "import os\n"
    "import sys\n"
    "\n"
    "def find_files(root, suffix):\n"
    "    result = []\n"
    "    for dirpath, dirnames, filenames in os.walk(root):\n"
    "        for name in filenames:\n",
    # properties with getters and setters
    "class Config:\n"
    "    @property\n"
    "    def name(self):\n"
    "        return self._name\n"
    "\n"
    "    @name.setter\n"
    "    def name(self, value):\n"
    "        self._name = value\n"
    "\n"
    "    @property\n"
    "    def path(self):\n",
]


def load_prompts(path: str | None, field: str = "--prompts") -> list[str]:
    """Prompts from a file: JSON list of strings, JSONL of {"prompt": ...}, or one per line (.txt)."""
    if path is None:
        return list(DEMO_PROMPTS)
    if not os.path.isfile(path):
        raise UsageError(f"{path!r} is not a file; pass a .txt (one prompt per line), .json "
                         f"(a list of strings) or .jsonl ({{\"prompt\": ...}} per line) file", field)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        if path.endswith(".json"):
            prompts = json.loads(text)
        elif path.endswith(".jsonl"):
            prompts = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
        else:
            prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"cannot read prompts from {path!r} ({type(e).__name__}: {e}); a .json file "
                         f"holds a list of strings, a .jsonl file one {{\"prompt\": ...}} per line",
                         field) from None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise UsageError(f"{path!r} must hold a non-empty list of non-empty prompt strings", field)
    return prompts
