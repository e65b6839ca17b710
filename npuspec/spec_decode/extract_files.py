"""The storage side of `extract_hidden_states`: the per-request `.safetensors` files (its
`kv_transfer_config` is parsed in extract_config.py).

`LLM(..., speculative_config={"method": "extract_hidden_states", ...},
kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
"kv_connector_extra_config": {"shared_storage_path": DIR}})` writes one file per finished
request, `DIR/{request id}.safetensors`, holding

- `token_ids`: int64 [num_tokens]
- `hidden_states`: [num_tokens, num_layers, hidden_size] in the model dtype

with metadata `{"format": "pt"}`, so `safetensors.torch.load_file` reads it.

Guarantees (docs/hidden_states.md):
- Crash-safe: the bytes go to a hidden temp file (`.NAME.safetensors.XXXXXXXX.tmp`) in the same dir,
  which is fsynced, renamed over the final name with `os.replace`, and the directory fsynced.
  A file under `*.safetensors` is always complete; a crash leaves at most a stray `.tmp`.
- Locking (when `use_synchronization_lock`): a companion `PATH.lock`; the writer holds
  `flock(LOCK_EX)` on it from `submit()` (when it is free at once, else from the writer thread)
  until the file is in place; `load_hidden_states` takes `LOCK_SH`, so a reader that got the
  path from a request's output waits for that request's write instead of seeing no file.
- `submit()` snapshots the tensors (a CPU copy) before it returns, so the caller may reuse its
  buffers (the KV blocks) at once; the writing itself runs on `num_writer_threads` threads.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import errno
import fcntl
import json
import os
import struct
import threading
import uuid
from typing import Any, Optional, Union

import numpy as np
import torch

from npuspec.spec_decode.extract_config import (REQUEST_PATH_KEY, SPEC_METHOD, KVTransferConfig,
                                                arg_error)

SUFFIX = ".safetensors"
LOCK_SUFFIX = ".lock"
TMP_SUFFIX = ".tmp"
# The escaped request id's limit, so that NAME.safetensors.lock and
# .NAME.safetensors.XXXXXXXX.tmp stay under the usual 255-byte file-name limit.
MAX_NAME = 200
_CHUNK = 64 << 20  # bytes per write() of tensor data

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


# --------------------------------------------------------------------------------------------
# file names

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def escape_request_id(req_id: Any) -> str:
    """A request id -> a file-name stem that cannot leave the directory: every byte outside
    [A-Za-z0-9._-] (so `/`, NUL and `%` itself) becomes `%XX`, and a leading `.` too (no hidden
    names, no `.` or `..`). Ids made of safe characters are kept as they are; distinct ids give
    distinct names."""
    if not isinstance(req_id, str) or not req_id:
        raise arg_error("request_id", req_id, "must be a non-empty string")
    out = []
    for i, ch in enumerate(req_id):
        if ch in _SAFE and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    name = "".join(out)
    if len(name.encode()) > MAX_NAME:
        raise arg_error("request_id", req_id if len(req_id) <= 80 else req_id[:80] + "...",
                   f"is too long for a file name ({len(name)} bytes escaped, limit {MAX_NAME}); "
                   "use shorter request ids")
    return name


def lock_path(path: str) -> str:
    return path + LOCK_SUFFIX


# --------------------------------------------------------------------------------------------
# flock on the companion lock file


def _open_locked(lpath: str, exclusive: bool, create: bool, blocking: bool = True) -> Optional[int]:
    """Open `lpath` and flock it -> fd, or None (the file is missing and create is False, or
    not blocking and the lock is held elsewhere). Retries when the file was unlinked or replaced
    while waiting (cleanup removes lock files), so a lock taken here is on the current file."""
    op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
    while True:
        try:
            if create:
                fd = os.open(lpath, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            else:
                fd = os.open(lpath, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if create:
                raise
            return None
        try:
            fcntl.flock(fd, op)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(lpath).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # locked a removed lock file: try again with the current one


def _unlock(fd: Optional[int]) -> None:
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------------
# writing


def _write_all(fd: int, buf) -> None:
    """Write every byte of `buf` (one piece of the file) to `fd`."""
    mv = memoryview(buf).cast("B")
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def _serialize(fd: int, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Stream a safetensors file to `fd` straight from the (contiguous CPU) tensors' memory:
    8-byte little-endian header length, JSON header padded with spaces to a multiple of 8,
    then the data in header order."""
    header: dict[str, Any] = {}
    off = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    _write_all(fd, struct.pack("<Q", len(hb)) + hb)
    for t in tensors.values():
        data = _tensor_bytes(t)
        for i in range(0, data.size, _CHUNK):
            _write_all(fd, data[i:i + _CHUNK])


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_hidden_states_file(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write `tensors` (contiguous, CPU) to `path` atomically: hidden temp file in the same
    directory, fsync, os.replace, fsync of the directory. No locking here."""
    d, base = os.path.split(path)
    d = d or "."
    tmp = os.path.join(d, f".{base}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            _serialize(fd, tensors, {"format": "pt"})
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(d)


class HiddenStatesWriteError(RuntimeError):
    """A background write failed; `.path` is the file, `__cause__` the original error."""

    def __init__(self, path: str, cause: BaseException, others: int = 0):
        more = f" ({others} more write(s) failed too)" if others else ""
        super().__init__(f"writing hidden states to {path!r} failed: "
                         f"{type(cause).__name__}: {cause}{more}")
        self.path = path


class HiddenStatesWriter:
    """Writes one `.safetensors` file per request on a pool of `cfg.num_writer_threads` threads.

    `submit()` returns the file's path at once (the file appears there, complete, when its write
    finishes); `flush()` waits for every pending write and raises the first failure;
    `close()` flushes and stops the threads. Also a context manager."""

    def __init__(self, cfg: Union[KVTransferConfig, dict, str],
                 dtype: Optional[torch.dtype] = None):
        cfg = KVTransferConfig.from_dict(cfg)
        self.cfg = cfg
        if dtype is not None and dtype not in _ST_DTYPES:
            raise arg_error("dtype", dtype, f"hidden states are stored as one of "
                       f"{', '.join(str(t) for t in _ST_DTYPES)}")
        self.dtype = dtype
        self.directory = os.path.abspath(cfg.shared_storage_path)
        try:
            os.makedirs(self.directory, mode=0o755, exist_ok=True)
        except OSError as e:
            raise arg_error("kv_transfer_config.kv_connector_extra_config.shared_storage_path",
                       cfg.shared_storage_path, f"cannot create the directory ({e}); "
                       "use a writable directory such as /dev/shm/hidden_states") from None
        if not os.path.isdir(self.directory) or not os.access(self.directory, os.W_OK | os.X_OK):
            raise arg_error("kv_transfer_config.kv_connector_extra_config.shared_storage_path",
                       cfg.shared_storage_path, "is not a writable directory; use one that is")
        self._pool = cf.ThreadPoolExecutor(max_workers=cfg.num_writer_threads,
                                           thread_name_prefix="npuspec-hidden-states")
        self._cond = threading.Condition()
        self._pending = 0
        self._queues: dict[str, collections.deque] = {}  # path -> writes waiting for its task
        self._errors: list[tuple[str, BaseException]] = []
        self._closed = False

    # ---- paths
    def path_for(self, req_id: str, path: Optional[str] = None) -> str:
        """The file a request's hidden states go to: `{shared_storage_path}/{req_id}.safetensors`
        (the id escaped, see `escape_request_id`), or the request's own `path` when
        allow_custom_save_path is on."""
        if path is not None:
            if not self.cfg.allow_custom_save_path:
                raise arg_error(REQUEST_PATH_KEY, path,
                           "a request may choose its file only with kv_transfer_config."
                           "kv_connector_extra_config.allow_custom_save_path=True; set it or "
                           "drop the request's hidden_states_path")
            p = os.fspath(path) if isinstance(path, os.PathLike) else path
            if not isinstance(p, str) or not p or "\0" in p or p.endswith(os.sep):
                raise arg_error(REQUEST_PATH_KEY, path, "must be a file path string such as "
                           "'/data/hs/sample_0.safetensors'")
            return os.path.abspath(p)
        return os.path.join(self.directory, escape_request_id(req_id) + SUFFIX)

    # ---- writing
    def submit(self, req_id: str, token_ids, hidden_states: torch.Tensor,
               path: Optional[str] = None) -> str:
        """Queue a request's file -> its path. `token_ids`: list of ints or a 1-D numpy/torch
        integer array of num_tokens; `hidden_states`: [num_tokens, num_layers, hidden_size]
        on any device. Both are copied to CPU before this returns."""
        if self._closed:
            raise RuntimeError("HiddenStatesWriter.submit after close()")
        dest = self.path_for(req_id, path)
        tok, hs = self._snapshot(req_id, token_ids, hidden_states)
        d = os.path.dirname(dest)
        if d != self.directory:
            os.makedirs(d, mode=0o755, exist_ok=True)
        with self._cond:
            self._pending += 1
            queue = self._queues.get(dest)
            if queue is not None:  # a write of this path is pending: this one goes after it
                queue.append((tok, hs))
                return dest
            self._queues[dest] = collections.deque()
        held = None
        try:
            if self.cfg.use_synchronization_lock:
                # Take the lock now when it is free, so that a reader who got `dest` from the
                # request's output waits for this write; else the writer thread waits for it.
                held = _open_locked(lock_path(dest), exclusive=True, create=True,
                                    blocking=False)
            self._pool.submit(self._run, dest, tok, hs, held)
        except BaseException:
            _unlock(held)
            with self._cond:
                self._pending -= 1 + len(self._queues.pop(dest))
                self._cond.notify_all()
            raise
        return dest

    def _snapshot(self, req_id, token_ids, hidden_states) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            raise arg_error("hidden_states", getattr(hidden_states, "shape", type(hidden_states)),
                       f"request {req_id!r}: must be a tensor [num_tokens, num_layers, "
                       "hidden_size]")
        if isinstance(token_ids, torch.Tensor):
            t = token_ids.detach()
        else:
            a = np.asarray(token_ids)
            if a.size == 0:
                a = a.astype(np.int64)
            t = torch.from_numpy(np.ascontiguousarray(a)) if a.dtype != object else None
        if (t is None or t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex
                or t.dtype == torch.bool):
            raise arg_error("token_ids", token_ids if isinstance(token_ids, list) and len(token_ids) < 20
                       else type(token_ids), f"request {req_id!r}: must be a 1-D list or array "
                       "of integer token ids")
        if t.shape[0] != hidden_states.shape[0]:
            raise arg_error("token_ids", f"<{t.shape[0]} ids>",
                       f"request {req_id!r}: hidden_states has {hidden_states.shape[0]} rows; "
                       "there must be one token id per row")
        dtype = self.dtype or hidden_states.dtype
        if dtype not in _ST_DTYPES:
            raise arg_error("hidden_states.dtype", hidden_states.dtype,
                       f"must be one of {', '.join(str(x) for x in _ST_DTYPES)}")
        tok = torch.empty(t.shape, dtype=torch.int64)
        tok.copy_(t)
        hs = torch.empty(hidden_states.shape, dtype=dtype)
        hs.copy_(hidden_states.detach())
        return tok, hs

    def _run(self, dest: str, tok: torch.Tensor, hs: torch.Tensor, held: Optional[int]) -> None:
        # One task per path at a time, so writes of one path land in submission order.
        while True:
            self._write(dest, tok, hs, held)
            with self._cond:
                queue = self._queues[dest]
                if not queue:
                    del self._queues[dest]
                    return
                (tok, hs), held = queue.popleft(), None

    def _write(self, dest: str, tok: torch.Tensor, hs: torch.Tensor, held: Optional[int]) -> None:
        fd, error = held, None
        try:
            if fd is None and self.cfg.use_synchronization_lock:
                fd = _open_locked(lock_path(dest), exclusive=True, create=True)
            write_hidden_states_file(dest, {"token_ids": tok, "hidden_states": hs})
        except BaseException as e:  # reported by flush()
            error = e
        finally:
            try:
                _unlock(fd)
            except OSError as e:
                error = error or e
            self._finish(dest, error)

    def _finish(self, dest: Optional[str], error: Optional[BaseException]) -> None:
        with self._cond:
            if error is not None:
                self._errors.append((dest, error))
            self._pending -= 1
            self._cond.notify_all()

    @property
    def num_pending(self) -> int:
        """Writes submitted and not finished yet."""
        with self._cond:
            return self._pending

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait until no write is pending; raise HiddenStatesWriteError for the first one that
        failed since the last flush (the failures are then forgotten). TimeoutError if `timeout`
        seconds pass first."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0, timeout=timeout):
                raise TimeoutError(f"HiddenStatesWriter.flush: {self._pending} write(s) still "
                                   f"running after {timeout} s")
            errors, self._errors = self._errors, []
        if errors:
            path, exc = errors[0]
            raise HiddenStatesWriteError(path, exc, len(errors) - 1) from exc

    def close(self) -> None:
        """Flush (raising the first failure) and stop the writer threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> "HiddenStatesWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# reading and cleanup


def _not_found(path: str) -> FileNotFoundError:
    return FileNotFoundError(
        errno.ENOENT, f"no hidden states file at {path!r}; it is written for each finished request "
        f"by LLM(speculative_config={{'method': {SPEC_METHOD!r}, ...}}, kv_transfer_config=...), "
        "which returns its path as output.kv_transfer_params['hidden_states_path'] (or it was "
        "already removed by cleanup_hidden_states)", path)


def load_hidden_states(path: str) -> dict[str, torch.Tensor]:
    """Read a hidden states file -> {"token_ids", "hidden_states"}, under LOCK_SH on its lock
    file (when one exists, or can be created next to an existing file), so an in-progress write
    of the same path is waited for."""
    path = os.fspath(path)
    from safetensors.torch import load_file
    fd = _open_locked(lock_path(path), exclusive=False, create=False)
    if fd is None:
        if not os.path.exists(path):
            raise _not_found(path)
        try:
            fd = _open_locked(lock_path(path), exclusive=False, create=True)
        except OSError:
            fd = None  # read-only directory: read without the lock
    try:
        if not os.path.exists(path):
            raise _not_found(path)
        return load_file(path)
    finally:
        _unlock(fd)


def cleanup_hidden_states(path: str, keep_hidden_states: bool = False) -> None:
    """Remove a hidden states file (unless keep_hidden_states) and its lock file, under LOCK_EX
    (waits for readers and a running write). Missing files are fine."""
    path = os.fspath(path)
    lpath = lock_path(path)
    fd = _open_locked(lpath, exclusive=True, create=False)
    try:
        if not keep_hidden_states:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if fd is not None:
            try:
                os.unlink(lpath)
            except FileNotFoundError:
                pass
    finally:
        _unlock(fd)
