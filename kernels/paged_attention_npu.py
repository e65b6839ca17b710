"""NPU path of `npuspec::paged_attention`: `torch_npu.npu_fused_infer_attention_score` (FIA).

UNVERIFIED ON ASCEND HARDWARE. Written against the torch_npu API documentation
(`torch_npu.npu_fused_infer_attention_score`, its `.out` variant, the
`_npu_fused_infer_attention_score_get_max_workspace` helper, `torch.npu.graph_task_group_begin/end`,
`torch.npu.graph_task_update_begin/end`, `torch.npu.ExternalEvent`) and tested only against a fake
torch_npu that implements the documented semantics on CPU (tests/kernels/test_paged_attention_npu.py).
See docs/attention_npu.md.

Eager call, one per layer (the contract is in kernels/paged_attention.py):

    out, _ = torch_npu.npu_fused_infer_attention_score(
        q.view(B*T, H, D),                                   # TND
        k_pool[layer].view(num_blocks, block_size, Hkv*D),   # paged: layout "(blocknum, blocksize, H)"
        v_pool[layer].view(num_blocks, block_size, Hkv*D),
        atten_mask=<2048x2048 int8, 1 above the diagonal>, sparse_mode=3,   # rightDownCausal
        actual_seq_lengths=[T, 2T, ..., B*T],                # host list, cumulative query ends
        actual_seq_lengths_kv=[max(n_b, 1) for n_b in seq_lens],   # host list, per row
        block_table=block_table (int32 [B, MB]), block_size=block_size,
        num_heads=H, num_key_value_heads=Hkv, scale=scale, input_layout="TND")

rightDownCausal aligns each row's T queries with the last T of its n_b keys, which is the
contract's "query t sits at position n_b - T + t". FIA wants a positive kv length, so padding rows
(n_b = 0) are passed as 1; every query whose contract position n_b - T + t is negative (padding
rows, and left-padded rows with n_b < T) is then zeroed on device from the `seq_lens` tensor, so
that step is graph-safe and the contract's zeros hold whatever FIA writes there.

The eager call reads `seq_lens` to the host (`.tolist()`, one device sync per call), because FIA's
lengths are `SymInt[]` host lists that feed its host-side tiling.

ACL graphs freeze those host lists at capture, so the graph-capture path implements torch_npu's
"graph task update": while a stream is capturing (`torch.npu.is_current_stream_capturing()`), each
call records, for the graph being captured (`GRAPH_UPDATES.capturing(key)`), an ExternalEvent
(waited on and reset inside the graph), a max-size workspace, the static tensors and the
parameters, and issues `npu_fused_infer_attention_score.out` between
`graph_task_group_begin/end`, which returns the task-group handle. Before every replay,
`GRAPH_UPDATES.before_replay(key)` re-issues each recorded call with the new lengths between
`graph_task_update_begin/end` on a side stream and records the event, which releases the
captured attention task. The graph runner's part is three lines (docs/attention_npu.md).

torch_npu is imported lazily, only when this path runs (docs/design.md, "Platforms").
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Hashable, Optional, Sequence

import torch
from torch import Tensor

# FIA constraints from the torch_npu API doc (page attention; TND; rightDownCausal mask).
MAX_QUERY_TOKENS = 16            # T = K+1 per request (npuspec.platform checks it up front too)
MASK_SIZE = 2048                 # sparse_mode 2/3/4 take the optimised 2048x2048 mask
SPARSE_RIGHT_DOWN_CAUSAL = 3
BLOCK_SIZE_MIN, BLOCK_SIZE_MAX, BLOCK_SIZE_STEP = 128, 512, 128
DTYPES = (torch.float16, torch.bfloat16)
LAYOUT = "TND"


def _torch_npu():
    try:
        import torch_npu
    except Exception as e:  # absent, or installed without CANN
        raise RuntimeError(
            "npuspec paged_attention on npu needs torch_npu (pip install npuspec[npu], with "
            f"CANN); import failed: {e}") from e
    return torch_npu


def _npu_api():
    npu = getattr(torch, "npu", None)
    if npu is None:
        _torch_npu()  # registers torch.npu
        npu = torch.npu
    return npu


def is_capturing() -> bool:
    """An ACL graph is being captured on the current NPU stream."""
    npu = _npu_api()
    fn = getattr(npu, "is_current_stream_capturing", None)
    return bool(fn()) if fn is not None else False


_MASKS: dict = {}


def causal_mask(device) -> Tensor:
    """FIA's compressed causal mask for sparse_mode 3: int8 [2048, 2048], 1 = masked (j > i).

    Built once per device, on the device (so a first build inside a capture issues no host copy);
    the warm-up runs before a capture normally build it eagerly."""
    key = str(device)
    m = _MASKS.get(key)
    if m is None:
        m = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8, device=device),
                       diagonal=1)
        _MASKS[key] = m
    return m


def query_ends(B: int, T: int) -> list[int]:
    """actual_seq_lengths for TND: the cumulative query ends T, 2T, ..., B*T (host ints)."""
    return [T * (b + 1) for b in range(B)]


def kv_lengths(seq_lens_host: Sequence[int], B: int) -> list[int]:
    """actual_seq_lengths_kv: per-row kv lengths as host ints, padding rows (0) passed as 1.

    A list shorter than B is padded with padding rows; the row's output is zeroed on device."""
    lens = [int(n) for n in seq_lens_host]
    if len(lens) > B:
        raise ValueError(f"{len(lens)} seq_lens for a batch of {B} rows")
    lens += [0] * (B - len(lens))
    if any(n < 0 for n in lens):
        raise ValueError(f"negative seq_lens: {lens}")
    return [max(n, 1) for n in lens]


def check_supported(q: Tensor, k_cache: Tensor, block_size: int) -> None:
    """The documented FIA limits npuspec relies on; clear errors instead of an aclnn failure."""
    B, T, H, D = q.shape
    Hkv = k_cache.shape[2]
    if T > MAX_QUERY_TOKENS:
        raise ValueError(f"npu paged attention: {T} query tokens per request; "
                         f"npu_fused_infer_attention_score (TND) takes at most {MAX_QUERY_TOKENS} "
                         f"(num_speculative_tokens <= {MAX_QUERY_TOKENS - 1})")
    if not (BLOCK_SIZE_MIN <= block_size <= BLOCK_SIZE_MAX and block_size % BLOCK_SIZE_STEP == 0):
        raise ValueError(f"npu paged attention: block_size={block_size}; FIA page attention "
                         f"needs a multiple of {BLOCK_SIZE_STEP} in "
                         f"[{BLOCK_SIZE_MIN}, {BLOCK_SIZE_MAX}] (use 128)")
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype:
        raise TypeError(f"npu paged attention: q {q.dtype}, kv {k_cache.dtype}; FIA page "
                        f"attention takes float16/bfloat16 with kv in q's dtype")
    if D % 16:
        raise ValueError(f"npu paged attention: head dim {D}; FIA needs it 16-aligned")
    if Hkv * D > 65535:
        raise ValueError(f"npu paged attention: Hkv*D={Hkv * D} > 65535 in the "
                         f"(blocknum, blocksize, H) kv layout")
    if H // Hkv > 64:
        raise ValueError(f"npu paged attention: {H // Hkv} query heads per kv head; FIA takes <= 64")
    if not k_cache.is_contiguous():
        raise ValueError("npu paged attention: the kv pool must be contiguous")


@dataclasses.dataclass
class _Args:
    """One FIA call: the tensors and every parameter except the two host length lists."""
    query: Tensor
    key: Tensor
    value: Tensor
    block_table: Tensor
    atten_mask: Tensor
    num_heads: int
    num_key_value_heads: int
    scale: float
    block_size: int
    B: int
    T: int

    def kwargs(self, kv_lens: list[int], block_table: Optional[Tensor] = None) -> dict:
        return dict(atten_mask=self.atten_mask,
                    actual_seq_lengths=query_ends(self.B, self.T),
                    actual_seq_lengths_kv=kv_lens,
                    block_table=self.block_table if block_table is None else block_table,
                    num_heads=self.num_heads,
                    scale=self.scale,
                    input_layout=LAYOUT,
                    num_key_value_heads=self.num_key_value_heads,
                    sparse_mode=SPARSE_RIGHT_DOWN_CAUSAL,
                    block_size=self.block_size)


def _build(q, k_cache, v_cache, layer, block_table, block_size, scale) -> _Args:
    B, T, H, D = q.shape
    Hkv = k_cache.shape[2]
    nb = k_cache.shape[1] // block_size
    return _Args(query=q.reshape(B * T, H, D).contiguous(),
                 key=k_cache[layer].view(nb, block_size, Hkv * D),
                 value=v_cache[layer].view(nb, block_size, Hkv * D),
                 block_table=block_table.contiguous(),
                 atten_mask=causal_mask(q.device),
                 num_heads=H, num_key_value_heads=Hkv, scale=float(scale),
                 block_size=int(block_size), B=B, T=T)


def _zero_invisible(out: Tensor, seq_lens: Tensor, B: int, T: int) -> Tensor:
    """[B*T, H, D] -> [B, T, H, D], queries at a negative position zeroed (device-side)."""
    o = out.view(B, T, *out.shape[1:])
    qpos = seq_lens.to(torch.int64)[:, None] - T + torch.arange(T, device=out.device)
    return o.masked_fill_((qpos < 0)[:, :, None, None], 0)


# --- ACL graph task update -----------------------------------------------------------------

@dataclasses.dataclass
class CapturedCall:
    """What one FIA call captured into a graph needs to be re-issued before a replay."""
    handle: Any            # from torch.npu.graph_task_group_end
    event: Any             # torch.npu.ExternalEvent, waited on + reset inside the graph
    workspace: Tensor      # from _npu_fused_infer_attention_score_get_max_workspace
    args: _Args            # static tensors + parameters
    out: Tensor            # static output [B*T, H, D]
    softmax_lse: Tensor
    seq_lens: Tensor       # the static device seq_lens buffer this call saw at capture
    kv_lens: list          # host lengths the task was last issued with


class GraphUpdates:
    """Registry of the FIA calls captured per ACL graph, and their per-replay update.

    The graph runner calls, around its capture and before each replay:

        with GRAPH_UPDATES.capturing(key):       # key: any hashable naming this graph
            with torch.npu.graph(g, pool=...):
                outs = fn(*static_args)
        ...
        GRAPH_UPDATES.before_replay(key)         # then g.replay()

    `begin_capture(key)` / `end_capture(key)` are the same without a context manager;
    `drop(key)` forgets a graph's records when the graph is freed.
    """

    def __init__(self):
        self._records: dict[Hashable, list[CapturedCall]] = {}
        self._current: Optional[Hashable] = None
        self._stream = None
        self._lock = threading.Lock()

    # capture side
    def begin_capture(self, key: Hashable) -> None:
        with self._lock:
            if self._current is not None:
                raise RuntimeError(f"GRAPH_UPDATES.begin_capture({key!r}) while capturing "
                                   f"{self._current!r}")
            self._current = key
            self._records[key] = []

    def end_capture(self, key: Hashable) -> None:
        with self._lock:
            if self._current != key:
                raise RuntimeError(f"GRAPH_UPDATES.end_capture({key!r}): capturing "
                                   f"{self._current!r}")
            self._current = None

    @contextlib.contextmanager
    def capturing(self, key: Hashable):
        self.begin_capture(key)
        try:
            yield
        finally:
            self.end_capture(key)

    def _add(self, rec: CapturedCall) -> None:
        if self._current is None:
            raise RuntimeError(
                "npu paged attention is being captured into an ACL graph that nobody will "
                "update: FIA's sequence lengths are host lists fixed at capture. Wrap the capture "
                "in npuspec.kernels.paged_attention_npu.GRAPH_UPDATES.capturing(key) and call "
                "GRAPH_UPDATES.before_replay(key) before each replay (docs/attention_npu.md)")
        self._records[self._current].append(rec)

    # replay side
    def records(self, key: Hashable) -> list[CapturedCall]:
        return self._records.get(key, [])

    def keys(self) -> list:
        return list(self._records)

    def drop(self, key: Hashable) -> None:
        self._records.pop(key, None)

    def update_stream(self):
        if self._stream is None:
            self._stream = _npu_api().Stream()
        return self._stream

    def before_replay(self, key: Hashable, seq_lens_host: Optional[Sequence[int]] = None,
                      block_table: Optional[Tensor] = None) -> int:
        """Re-issue every FIA call captured in graph `key` with this step's lengths.

        seq_lens_host: the rows' kv lengths as host ints (the values the static seq_lens buffer
        holds for this replay; shorter lists are padded with padding rows). None reads each
        recorded static seq_lens buffer once (one device sync per distinct buffer).
        block_table: a replacement block-table tensor (same shape and dtype as the captured one;
        kept alive until the next update); None keeps the captured buffer, whose contents the
        dispatcher refills. Returns the number of calls updated (0 for a graph without FIA).
        """
        recs = self._records.get(key)
        if not recs:
            return 0
        npu, tnpu = _npu_api(), _torch_npu()
        host: dict[int, list[int]] = {}
        for r in recs:
            src = seq_lens_host
            if src is None:
                k = id(r.seq_lens)
                if k not in host:
                    host[k] = r.seq_lens.tolist()
                src = host[k]
            r.kv_lens = kv_lengths(src, r.args.B)
        if block_table is not None:
            bt0 = recs[0].args.block_table
            if block_table.shape != bt0.shape or block_table.dtype != torch.int32:
                raise ValueError(f"before_replay: block_table {tuple(block_table.shape)} "
                                 f"{block_table.dtype}; captured {tuple(bt0.shape)} int32")
            block_table = block_table.contiguous()
        stream = self.update_stream()
        # The patch must not land while the previous replay (on the current stream) still runs.
        stream.wait_stream(npu.current_stream())
        with npu.stream(stream):
            for r in recs:
                if block_table is not None:
                    r.args.block_table = block_table
                npu.graph_task_update_begin(stream, r.handle)
                tnpu.npu_fused_infer_attention_score.out(
                    r.args.query, r.args.key, r.args.value, workspace=r.workspace,
                    out=[r.out, r.softmax_lse], **r.args.kwargs(r.kv_lens))
                npu.graph_task_update_end(stream)
                r.event.record(stream)
        return len(recs)


GRAPH_UPDATES = GraphUpdates()


def update_before_replay(graph_key: Hashable, seq_lens_host: Optional[Sequence[int]] = None,
                         block_table: Optional[Tensor] = None) -> int:
    """Module-level spelling of `GRAPH_UPDATES.before_replay`."""
    return GRAPH_UPDATES.before_replay(graph_key, seq_lens_host, block_table)


def _captured_call(a: _Args, seq_lens: Tensor, q: Tensor) -> Tensor:
    npu, tnpu = _npu_api(), _torch_npu()
    stream = npu.current_stream()
    # Placeholder lengths: every row T long (q_len <= kv_len, one block); the task is re-issued
    # with the real ones before every replay. The workspace is the documented max-size one.
    kv_lens = [a.T] * a.B
    kw = a.kwargs(kv_lens)
    workspace = tnpu._npu_fused_infer_attention_score_get_max_workspace(
        a.query, a.key, a.value, **kw)
    out = torch.empty_like(a.query)
    lse = torch.empty(1, dtype=q.dtype, device=q.device)  # softmax_lse_flag=False: [1]
    event = npu.ExternalEvent()
    event.wait(stream)
    event.reset(stream)
    npu.graph_task_group_begin(stream)
    tnpu.npu_fused_infer_attention_score.out(a.query, a.key, a.value, workspace=workspace,
                                             out=[out, lse], **kw)
    handle = npu.graph_task_group_end(stream)
    GRAPH_UPDATES._add(CapturedCall(handle, event, workspace, a, out, lse, seq_lens, kv_lens))
    return out


def npu_paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, layer: int,
                        block_table: Tensor, seq_lens: Tensor, block_size: int,
                        scale: float) -> Tensor:
    """The contract of kernels/paged_attention.py through FIA (unverified on hardware)."""
    B, T, H, D = q.shape
    check_supported(q, k_cache, block_size)
    a = _build(q, k_cache, v_cache, layer, block_table, block_size, scale)
    if is_capturing():
        out = _captured_call(a, seq_lens, q)
    else:
        tnpu = _torch_npu()
        out, _lse = tnpu.npu_fused_infer_attention_score(
            a.query, a.key, a.value, **a.kwargs(kv_lengths(seq_lens.tolist(), B)))
    return _zero_invisible(out, seq_lens, B, T)
