"""`kv_transfer_config` of `extract_hidden_states`: its keys, defaults and checks
(vLLM's ExampleHiddenStatesConnector schema; docs/hidden_states.md). The files themselves are
extract_files.py's."""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any, Optional

CONNECTORS = ("ExampleHiddenStatesConnector",)
KV_ROLES = ("kv_producer",)
TOP_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")
EXTRA_DEFAULTS = {
    "shared_storage_path": "/tmp",
    "num_writer_threads": 8,
    "use_synchronization_lock": True,
    "allow_custom_save_path": False,
}
EXAMPLE = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
           "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/hidden_states"}}
SPEC_METHOD = "extract_hidden_states"
REQUEST_PATH_KEY = "kv_transfer_params.hidden_states_path"
def arg_error(key: str, value: Any, fix: str) -> ValueError:
    # the phrasing of npuspec.engine.args.arg_error (the engine sits above this package)
    return ValueError(f"LLM: {key}={value!r}: {fix}")


def _choices(values) -> str:
    return ", ".join(repr(v) for v in values)


def _reject_unknown(d: dict, known, where: str) -> None:
    for k in d:
        if k not in known:
            near = difflib.get_close_matches(str(k), list(known), n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"LLM: {where} has unknown key {k!r}; {hint}"
                             f"valid keys: {', '.join(known)}")


# --------------------------------------------------------------------------------------------
# kv_transfer_config


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's `kv_transfer_config` for ExampleHiddenStatesConnector, validated."""
    kv_connector: str = "ExampleHiddenStatesConnector"
    kv_role: str = "kv_producer"
    shared_storage_path: str = "/tmp"
    num_writer_threads: int = 8
    use_synchronization_lock: bool = True
    allow_custom_save_path: bool = False

    @classmethod
    def from_dict(cls, d: Any) -> "KVTransferConfig":
        cfg = parse_kv_transfer_config(d)
        if cfg is None:
            raise arg_error("kv_transfer_config", d, f"must be a dict such as {EXAMPLE!r}")
        return cfg

    def to_dict(self) -> dict:
        """vLLM's shape; `parse_kv_transfer_config(cfg.to_dict()) == cfg`."""
        return {"kv_connector": self.kv_connector, "kv_role": self.kv_role,
                "kv_connector_extra_config": {k: getattr(self, k) for k in EXTRA_DEFAULTS}}


def parse_kv_transfer_config(d: Any) -> Optional[KVTransferConfig]:
    """`LLM(kv_transfer_config=...)`: None, a KVTransferConfig, a dict of vLLM's shape or a JSON
    string of one -> KVTransferConfig (None for None). Bad keys, values and types raise a
    ValueError naming the key and value and listing what is accepted."""
    if d is None or isinstance(d, KVTransferConfig):
        return d
    if isinstance(d, (str, bytes)):
        try:
            d = json.loads(d)
        except ValueError as e:
            raise arg_error("kv_transfer_config", d, f"is not valid JSON ({e}); pass a dict or a JSON "
                       f"object such as {json.dumps(EXAMPLE)}") from None
    if not isinstance(d, dict):
        raise arg_error("kv_transfer_config", d, f"must be a dict (or JSON object) such as {EXAMPLE!r}")
    _reject_unknown(d, TOP_KEYS, "kv_transfer_config")
    for key, allowed in (("kv_connector", CONNECTORS), ("kv_role", KV_ROLES)):
        if key not in d:
            raise ValueError(f"LLM: kv_transfer_config.{key} is required; supported: "
                             f"{_choices(allowed)} (e.g. {EXAMPLE!r})")
        if d[key] not in allowed:
            raise arg_error(f"kv_transfer_config.{key}", d[key], f"supported: {_choices(allowed)}")
    extra = d.get("kv_connector_extra_config")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise arg_error("kv_transfer_config.kv_connector_extra_config", extra,
                   f"must be a dict with keys {', '.join(EXTRA_DEFAULTS)}, e.g. "
                   f"{EXAMPLE['kv_connector_extra_config']!r}")
    where = "kv_transfer_config.kv_connector_extra_config"
    _reject_unknown(extra, tuple(EXTRA_DEFAULTS), where)
    vals = {**EXTRA_DEFAULTS, **extra}
    path = vals["shared_storage_path"]
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path or "\0" in path:
        raise arg_error(f"{where}.shared_storage_path", vals["shared_storage_path"],
                   "must be a non-empty directory path string (default '/tmp'; "
                   "'/dev/shm/...' for online use)")
    n = vals["num_writer_threads"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise arg_error(f"{where}.num_writer_threads", n, "must be an integer >= 1 (default 8)")
    for key in ("use_synchronization_lock", "allow_custom_save_path"):
        if not isinstance(vals[key], bool):
            raise arg_error(f"{where}.{key}", vals[key],
                       f"must be True or False (default {EXTRA_DEFAULTS[key]})")
    return KVTransferConfig(kv_connector=d["kv_connector"], kv_role=d["kv_role"],
                            shared_storage_path=path, num_writer_threads=n,
                            use_synchronization_lock=vals["use_synchronization_lock"],
                            allow_custom_save_path=vals["allow_custom_save_path"])


def check_with_spec(kv_cfg: Optional[KVTransferConfig], spec_method: Optional[str]) -> None:
    """kv_transfer_config and speculative_config.method must come together:
    ExampleHiddenStatesConnector only stores what method extract_hidden_states captures."""
    if kv_cfg is not None and spec_method != SPEC_METHOD:
        raise arg_error("speculative_config.method", spec_method,
                   f"kv_transfer_config (kv_connector={kv_cfg.kv_connector!r}) stores the hidden "
                   f"states captured by method {SPEC_METHOD!r}; set speculative_config.method="
                   f"{SPEC_METHOD!r} or drop kv_transfer_config")
    if kv_cfg is None and spec_method == SPEC_METHOD:
        raise ValueError(f"LLM: speculative_config.method={SPEC_METHOD!r} needs a "
                         f"kv_transfer_config telling where to write the hidden states; pass "
                         f"kv_transfer_config={EXAMPLE!r}")
