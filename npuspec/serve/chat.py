"""The checkpoint's chat template, rendered with Jinja2 the way HF `apply_chat_template` does
(sandboxed, trim_blocks + lstrip_blocks, `raise_exception`, `strftime_now`, `tojson`).

Where the template comes from: an HF directory's `chat_template.jinja` or the
`chat_template` of its `tokenizer_config.json`; a GGUF file's `tokenizer.chat_template`.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Optional

from npuspec.cli_util.errors import MissingExtra
from npuspec.models.gguf import find_gguf, read_gguf_chat_template
from npuspec.models.loading import resolve_model_dir


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str = ""):
        try:  # the [serve] extra
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise MissingExtra("jinja2", "serve", "chat templates") from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False,
                                                                  indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.bos_token, self.eos_token, self.origin = bos_token, eos_token, origin

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)


def _raise(msg):
    raise ValueError(msg)


def _token_text(v) -> str:
    if isinstance(v, dict):  # tokenizer_config.json's AddedToken form
        v = v.get("content")
    return v if isinstance(v, str) else ""


def load_chat_template(model: str) -> Optional[ChatTemplate]:
    """The model's chat template, or None when it has none."""
    gguf_file = find_gguf(model)
    if gguf_file is not None:
        return _gguf_template(gguf_file)
    d = resolve_model_dir(model)
    cfg_path = os.path.join(d, "tokenizer_config.json")
    cfg = {}
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path} is not valid JSON ({e}); re-download it from the "
                                 f"model's repository") from None
    src, origin = cfg.get("chat_template"), cfg_path
    jinja = os.path.join(d, "chat_template.jinja")
    if os.path.isfile(jinja):  # newer HF checkpoints keep it in its own file
        with open(jinja, encoding="utf-8") as f:
            src, origin = f.read(), jinja
    if isinstance(src, list):  # named templates: the default one
        src = next((t.get("template") for t in src if t.get("name") == "default"), None)
    if not isinstance(src, str) or not src:
        return None
    return ChatTemplate(src, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")),
                        origin)


def _gguf_template(path: str) -> Optional[ChatTemplate]:
    src, bos, eos = read_gguf_chat_template(path)
    return ChatTemplate(src, bos, eos, path) if src else None


def missing_reason(model: str) -> str:
    """Why the model has no template, for the 400 of a chat request."""
    if find_gguf(model) is not None:
        return f"the model's GGUF file {model} has no tokenizer.chat_template"
    return (f"the model {model} has no chat template (no chat_template in "
            f"tokenizer_config.json and no chat_template.jinja)")
