"""npuspec/models/arena.py: a packed model's weights in one huge-page arena, in step order."""
import mmap
from typing import Optional

import pytest
import torch

from npuspec import envs
from npuspec._counters import counters
from npuspec.kernels import linear_packed_cpu as lp
from npuspec.models import arena, load_model, quant
from npuspec.models.packing import pack_model

pytestmark = pytest.mark.skipif(not lp.available(), reason="no C++ toolchain for the kernel")


def _logits(model, ids):
    cache = model.allocate_cache(num_slots=1, max_len=32)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        return model(ids, pos, torch.zeros(1, dtype=torch.long), cache)


def _ids(model):
    return torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))


def _packed(dtype=torch.float32, monkeypatch=None, scheme=None):
    _, model = load_model("tiny", dtype=dtype)
    if scheme:
        quant.quantize_model(model, scheme)
    if monkeypatch is not None:
        monkeypatch.setenv("NPUSPEC_CPU_HUGEPAGES", "0")
    assert pack_model(model)
    return model


def _thp_eligible(t: torch.Tensor) -> Optional[bool]:
    """Whether the mapping holding t's first byte may use transparent huge pages, from
    /proc/self/smaps' THPeligible (None where the kernel does not say)."""
    addr = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == "THPeligible:":
                    return line.split()[1] == "1"
    except OSError:
        return None
    return None


def _thp_on() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("dtype,scheme", [(torch.float32, None), (torch.bfloat16, None),
                                          (torch.float32, "int4"), (torch.float32, "int8")])
def test_placed_weights_compute_what_they_did(monkeypatch, dtype, scheme):
    model = _packed(dtype, monkeypatch, scheme)          # packed, left where malloc put them
    assert not getattr(model, "weights_placed", False)
    ids = _ids(model)
    ref = _logits(model, ids)
    before = [(m, n, getattr(m, n).clone()) for m, n in arena.step_order(model)]
    size = arena.place_weights(model)
    assert size > 0 and model.weights_placed and arena.place_weights(model) == 0  # once
    slots = arena.step_order(model)
    assert [(m, n) for m, n, _ in before] == slots
    ptrs = []
    for m, n, old in before:
        t = getattr(m, n)
        assert torch.equal(t, old) and t.dtype == old.dtype and t.shape == old.shape
        assert t.is_contiguous() and t.data_ptr() % arena.ALIGN == 0
        ptrs.append(t.data_ptr())
    # one storage, laid out in the order a step reads the weights
    assert len({getattr(m, n).untyped_storage().data_ptr() for m, n in slots}) == 1
    assert ptrs == sorted(ptrs)
    assert getattr(*slots[0]).data_ptr() % arena.HUGE_PAGE == 0
    assert torch.equal(_logits(model, ids), ref)


def test_step_order_reads_layers_then_head():
    model = _packed()
    slots = arena.step_order(model)
    first = model.layers[0]
    assert [m for m, _ in slots[:4]] == [first.wqkv, first.wo, first.w13, first.w2]
    assert slots[-1] == (model, "head_packed")
    assert len(slots) == 4 * len(model.layers) + 1
    q = _packed(scheme="int4")  # codes, scales and minima of every projection, then the head's
    names = [n for _, n in arena.step_order(q)]
    assert names[:3] == ["codes", "scale", "minv"] and names[-3:] == ["codes", "scale", "minv"]


def test_pack_model_places_by_default_and_the_variable_turns_it_off(monkeypatch):
    monkeypatch.delenv("NPUSPEC_CPU_HUGEPAGES", raising=False)
    assert envs.cpu_hugepages()
    model = _packed()
    assert model.weights_placed
    if _thp_on():
        # advised: the kernel may back it with huge pages (None: it does not say)
        assert _thp_eligible(model.layers[0].wqkv.packed) is not False
    off = _packed(monkeypatch=monkeypatch)
    assert not getattr(off, "weights_placed", False)
    monkeypatch.setenv("NPUSPEC_CPU_HUGEPAGES", "yes please")
    with pytest.raises(envs.EnvError, match="NPUSPEC_CPU_HUGEPAGES"):
        envs.cpu_hugepages()


@pytest.mark.parametrize("missing", ["MADV_HUGEPAGE", "MAP_ANONYMOUS"])
def test_refused_advice_is_counted_and_the_weights_still_move(monkeypatch, missing):
    model = _packed(monkeypatch=monkeypatch)
    ids = _ids(model)
    ref = _logits(model, ids)
    monkeypatch.delattr(mmap, missing, raising=False)  # as on a platform without it
    before = counters.snapshot()
    assert arena.place_weights(model) > 0
    assert counters.delta(before).get("cpu_hugepage_advice_refused") == 1
    assert torch.equal(_logits(model, ids), ref)
