"""The code prompts `npuspec demo`, `bench e2e` and `tune` use by default, and the built-in
`--prompts code-edit` and `--prompts open-ended` sets.

Speculative decoding pays off when the continuation repeats what is already in the context
(editing code, filling in a pattern), which is what prompt lookup (ngram) drafts from. The
default prompts are short Python fragments in the style of the standard library the embedded
model was trained on, each with a pattern to continue.

`code-edit` (npuspec/bench/traces/code_edit.jsonl) is 6 code-editing requests as a user would
send them to a chat model: a Python function or class (15-30 lines) and an instruction to edit
it and return the whole code, so most of the answer copies the prompt. With a model whose
tokenizer has a chat template (HF `tokenizer_config.json`, or a GGUF's `tokenizer.chat_template`)
each is one user turn rendered by transformers' `apply_chat_template(add_generation_prompt=True)`;
without one (the embedded model) it is plain text ending in an opening code fence.

`open-ended` (npuspec/bench/traces/open_ended.jsonl) is the opposite regime: 24 chat requests
with little to copy from the context (explanations, stories, advice, how-tos, recipes,
comparisons; 3-5 of each kind), written for this project and shared with no training data.
Prompt lookup and suffix decoding have little to draft from there; it is the held-out set on
which model-based drafters are measured. Chat-templated like code-edit; without a template each
is "Question: ...\n\nAnswer:".
"""
from __future__ import annotations

import json
import os

from npuspec.cli_util.errors import UsageError
from npuspec.models.gguf import is_gguf_path

CODE_EDIT = "code-edit"
OPEN_ENDED = "open-ended"
BUILTIN_SETS = (CODE_EDIT, OPEN_ENDED)
_TRACES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "bench", "traces")
CODE_EDIT_FILE = os.path.join(_TRACES, "code_edit.jsonl")
OPEN_ENDED_FILE = os.path.join(_TRACES, "open_ended.jsonl")

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


def code_edit_requests() -> list[dict]:
    """The code-edit set: [{"name", "instruction", "code"}]."""
    with open(CODE_EDIT_FILE, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def code_edit_message(req: dict) -> str:
    """One request as the user turn's text: the instruction, then the code in a fence."""
    return f"{req['instruction']}\n\n```python\n{req['code']}```"


def code_edit_conversations() -> list[list[dict]]:
    """The code-edit set as chat conversations (one user message each), for apply_chat_template."""
    return [[{"role": "user", "content": code_edit_message(r)}] for r in code_edit_requests()]


def code_edit_plain() -> list[str]:
    """The code-edit set for a model without a chat template: the request, then the start of
    the answer (an opening code fence), so a base model continues with the edited code."""
    return [f"{code_edit_message(r)}\n\nHere is the edited code:\n\n```python\n"
            for r in code_edit_requests()]


def chat_tokenizer(model: str):
    """transformers' tokenizer of `model` (an HF directory or a .gguf file) when it has a chat
    template, else None (also when transformers is not installed, or cannot read the tokenizer)."""
    try:
        import transformers
        from transformers import AutoTokenizer
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    try:
        if is_gguf_path(model):
            tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(model)),
                                                gguf_file=os.path.basename(model))
        else:
            tok = AutoTokenizer.from_pretrained(model)
    except Exception:  # no tokenizer_config.json, an unknown tokenizer class, ...: no template
        return None
    return tok if getattr(tok, "chat_template", None) else None


def apply_template(tok, conversations: list[list[dict]]) -> list[str]:
    """Each conversation rendered by the tokenizer's chat template, ready for the assistant's turn."""
    return [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]


def code_edit_prompts(model: str | None = None, tok=None) -> list[str]:
    """The code-edit set for `model`: chat-templated text when its tokenizer has a template
    (`tok`, or looked up with chat_tokenizer), else code_edit_plain()."""
    tok = tok if tok is not None else (chat_tokenizer(model) if model else None)
    if tok is None:
        return code_edit_plain()
    return apply_template(tok, code_edit_conversations())


def open_ended_requests() -> list[dict]:
    """The open-ended set: [{"kind", "prompt"}]."""
    with open(OPEN_ENDED_FILE, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def open_ended_prompts(model: str | None = None, tok=None) -> list[str]:
    """The open-ended set for `model`: chat-templated when its tokenizer has a template, else
    "Question: ...\n\nAnswer:" for a base model."""
    reqs = open_ended_requests()
    tok = tok if tok is not None else (chat_tokenizer(model) if model else None)
    if tok is None:
        return [f"Question: {r['prompt']}\n\nAnswer:" for r in reqs]
    return apply_template(tok, [[{"role": "user", "content": r["prompt"]}] for r in reqs])


def builtin_prompts(name: str, model: str | None = None, tok=None) -> list[str]:
    """A built-in set by name (BUILTIN_SETS), formatted for `model` (see the module doc)."""
    return {CODE_EDIT: code_edit_prompts, OPEN_ENDED: open_ended_prompts}[name](model, tok)


def load_prompts(path: str | None, field: str = "--prompts", model: str | None = None) -> list[str]:
    """Prompts from a file: JSON list of strings, JSONL of {"prompt": ...}, or one per line
    (.txt); or a built-in set by name ('code-edit', 'open-ended', formatted for `model`, see
    module doc)."""
    if path is None:
        return list(DEMO_PROMPTS)
    if path in BUILTIN_SETS:
        return builtin_prompts(path, model)
    if not os.path.isfile(path):
        raise UsageError(f"{path!r} is not a file or a built-in set ({', '.join(BUILTIN_SETS)}); "
                         f"pass a .txt (one prompt per line), .json "
                         f"(a list of strings) or .jsonl ({{\"prompt\": ...}} per line) file", field)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise UsageError(f"{path!r} is not UTF-8 text ({e.reason} at byte {e.start}); save the "
                         f"prompts as UTF-8", field) from None
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
