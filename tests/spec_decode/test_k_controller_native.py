"""The K controller's C step (kernels/k_controller_cpu.py) against its Python reference: the
same choices and bit-equal state (acceptance rows and every cost table) over random steps,
with batches that change, requests that come and go, drafts of every length, a result array
laid out as the engine's, and step times that are measured, missing or stalled."""
import numpy as np
import pytest

from npuspec.kernels import k_controller_cpu
from npuspec.spec_decode import k_controller as kc

pytestmark = pytest.mark.skipif(not k_controller_cpu.available(),
                                reason="no C++ toolchain: the controller runs its reference")

KS = (0, 1, 2, 4)


def _pair(availability: bool, probes: bool = False):
    def rows_for(b, k):
        return -(-b // 8) * 8  # padded like a captured size
    out = []
    for native in (True, False):
        ctl = kc.KController(KS, rows_for, explore_every=5, availability=availability,
                             probes=probes, native=native)
        for rows in (8, 16, 24, 32, 40, 48):   # 56 and 64 rows: unmeasured (tried first)
            for k in KS:
                ctl.record_verify(rows, k, 1e-3 * (1 + 0.3 * k) * (1 + rows / 64))
        out.append(ctl)
    assert out[0]._lib is not None and out[1]._lib is None
    return out


class _Counted:
    """The library, counting its calls (so the test knows the native path ran)."""
    def __init__(self, lib):
        self.lib, self.calls = lib, {}

    def __getattr__(self, name):
        fn = getattr(self.lib, name)

        def call(*a):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a)
        return call


def _drafts(rng, B, k):
    """int64 [B, k], each row a prefix of ids then -1; a few rows with none."""
    lengths = rng.integers(0, k + 1, B)
    d = rng.integers(0, 1000, (B, k))
    d[np.arange(k)[None, :] >= lengths[:, None]] = -1
    return d


def _result(rng, B, k, lengths, rows):
    """res [rows, K+2] as the engine's step returns it: num_emitted - 1 accepted drafts."""
    res = np.full((rows, k + 2), -1, dtype=np.int32)
    acc = np.minimum(rng.integers(0, k + 1, B), np.minimum(lengths, k))
    res[:B, k + 1] = acc + 1
    return res


@pytest.mark.parametrize("min_batch,int64_res", [(1, False), (4, False), (1, True)])
@pytest.mark.parametrize("availability", [False, True])
def test_native_step_equals_the_numpy_reference(availability, min_batch, int64_res,
                                                monkeypatch):
    """min_batch 4: two-request steps of the same controller take the reference, so the state
    passes between the two paths. int64_res: every third step's result is int64, which the C
    step leaves to the reference (-2), so the reference writes the batch's rows between two
    C steps of the same batch (which read them in place through the kept slots)."""
    monkeypatch.setattr(kc, "NATIVE_MIN_BATCH", min_batch)
    nat, ref = _pair(availability)
    nat._lib = lib = _Counted(nat._lib)
    rng = np.random.default_rng(1 + availability)
    drafted = observed = 0
    picked = set()
    live = [f"r{i}" for i in range(40)]
    next_id = 40
    for step in range(300):
        if step % 7 == 0:  # requests finish and others arrive: the bound batch changes
            for rid in rng.choice(live, size=3, replace=False):
                live.remove(rid)
                nat.forget(rid), ref.forget(rid)
            live += [f"r{next_id + i}" for i in range(int(rng.integers(0, 6)))]
            next_id += 6
        # a few steps of two requests, where the numpy path runs (NATIVE_MIN_BATCH)
        batch = live[:64] if step % 50 < 40 else live[:2]
        native = len(batch) >= kc.NATIVE_MIN_BATCH
        s_n, s_r = nat.slots(batch), ref.slots(batch)
        if availability:
            ch_n, ch_r = nat.choose_before(s_n), ref.choose_before(s_r)
        else:
            ch_n, ch_r = nat.choose_before_cheap(len(batch)), ref.choose_before_cheap(len(batch))
        assert ch_n == ch_r, step
        drafts = (_drafts(rng, len(batch), ch_n.k_draft) if ch_n.k_draft
                  else np.full((len(batch), 0), -1, dtype=np.int64))
        drafted += native and ch_n.k_draft > 0
        k_n, L_n = nat.choose_after_drafts(ch_n, s_n, drafts)
        k_r, L_r = ref.choose_after_drafts(ch_r, s_r, drafts)
        assert k_n == k_r and np.array_equal(L_n, L_r), step
        rows = nat.rows_for(len(batch), k_n)
        res = _result(rng, len(batch), k_n, L_n, rows)
        if int64_res and step % 3 == 0:
            res = res.astype(np.int64)
        if native and ch_n.k_draft > 0 and (k_n > 0 or availability):
            observed += 1
        # the step's times: some not measured (NaN), a few stalled ones
        times = [float(x) if rng.random() > 0.2 else np.nan
                 for x in 1e-3 * rng.gamma(2.0, 1.0, 4) * (1 + 9 * (rng.random() < 0.05))]
        # drafting: cheap next to the step at first, then dear, so that drafting stops
        times[0] *= 0.02 if step < 150 else 5.0
        learn = k_n > 0 or availability
        nat.after_step(s_n, ch_n.k_draft, L_n, k_n, res, learn, rows, *times)
        ref.after_step(s_r, ch_r.k_draft, L_r, k_r, res, learn, rows, *times)
        nat.prefill_pending = ref.prefill_pending = bool(rng.random() < 0.3)
        for a, b in ((nat.p, ref.p), (nat.c, ref.c), (nat.pool_p, ref.pool_p),
                     (nat.pool_c, ref.pool_c)):
            assert np.array_equal(a, b), step
        for name in ("verify", "book", "book_per_req", "draft_s", "draft_values", "measured_at",
                     "window", "wn", "wpos", "scalars"):
            assert np.array_equal(getattr(nat.costs, name), getattr(ref.costs, name),
                                  equal_nan=True), (step, name)
        assert nat.last_k == ref.last_k and nat.last_cap == ref.last_cap, step
        picked.add(k_n)
    assert lib.calls["choose"] == drafted and drafted < step + 1, lib.calls
    assert lib.calls["verified"] >= observed > 100, lib.calls
    assert len(picked) >= 3, picked  # the choice moved: the decision itself was compared
    assert np.isnan(nat.costs.verify).sum() < nat.costs.verify.size  # times were kept


def test_native_after_drafts_reads_strided_drafts_and_an_unbound_batch():
    """Drafts sliced out of a wider array (row stride > K), and slots that are not the bound
    batch (a probe's copy): the same lengths, K and state as the reference."""
    nat, ref = _pair(False)
    rng = np.random.default_rng(7)
    ids = [f"r{i}" for i in range(24)]
    s_n, s_r = nat.slots(ids), ref.slots(ids)
    wide = _drafts(rng, 24, 6)
    drafts = wide[:, :4]
    assert drafts.strides[0] == 6 * 8
    ch = kc.Choice(4, 4)
    (k_n, L_n), (k_r, L_r) = (nat.choose_after_drafts(ch, s_n, drafts),
                              ref.choose_after_drafts(ch, s_r, drafts))
    assert k_n == k_r and np.array_equal(L_n, L_r)
    assert np.array_equal(L_n, (drafts >= 0).sum(1))
    res = _result(rng, 24, 4, L_n, 24)
    copy_n, copy_r = s_n.copy(), s_r.copy()  # not the bound array: read through it all the same
    nat.observe_result(copy_n, 4, L_n.copy(), 4, res)
    ref.observe_result(copy_r, 4, L_r.copy(), 4, res)
    assert np.array_equal(nat.c, ref.c)
    assert not np.array_equal(nat.c[s_n], np.full((24, 4), kc.PRIOR_C))  # it did learn


def test_probe_match_is_the_python_loop():
    """OnlineK._resolve's comparison in C against its Python loop: outputs shorter than the
    probe's K (none at all, a start past the end), drafts -1 padded, matches of every length,
    drafted lengths below K; and layouts it does not read (int32 drafts, strided lengths) are
    refused with nothing written."""
    from types import SimpleNamespace

    from npuspec.engine.k_online import OnlineK, Probe
    lib, rng, seen = k_controller_cpu.library(), np.random.default_rng(0), set()
    for trial in range(50):
        B, K = int(rng.integers(1, 20)), int(rng.integers(1, 6))
        drafts = _drafts(rng, B, K) % 7 - (_drafts(rng, B, K) < 0)  # few ids: matches happen
        reqs, starts = [], []
        for b in range(B):
            start = int(rng.integers(0, 5))
            n = int(rng.integers(0, K + 3))  # tokens past the start (0: none yet)
            tail = [int(t) if rng.random() < 0.7 and t >= 0 else int(rng.integers(0, 7))
                    for t in list(drafts[b]) + [0] * 3][:n]
            out = [int(x) for x in rng.integers(0, 7, start)] + tail
            if rng.random() < 0.1:  # preempted: its output shorter than the start
                out = out[:max(start - 1, 0)]
            reqs.append(SimpleNamespace(output=out, req_id=f"r{b}"))
            starts.append(start)
        lengths = rng.integers(0, K + 1, B)
        pr = Probe(0, reqs, np.arange(B), starts, drafts.copy(), lengths)
        res_c, res_py = np.zeros((B, K + 2), np.int32), np.zeros((B, K + 2), np.int32)
        have_c, have_py = np.empty(B, np.int64), np.empty(B, np.int64)
        assert lib.probe_match(reqs, starts, drafts, lengths, res_c, have_c) == B
        OnlineK._match_py(pr, res_py, have_py)
        assert np.array_equal(res_c, res_py) and np.array_equal(have_c, have_py), trial
        seen |= {int(m) for m in res_py[:, -1]}
    res = np.zeros((B, K + 2), np.int32)
    strided = np.repeat(lengths, 2)[::2]   # a view with stride 2: not read as contiguous
    for args in ((drafts.astype(np.int32), lengths), (drafts, strided)):
        assert lib.probe_match(reqs, starts, *args, res, have_c) == -2
    assert not res.any()
    assert seen == set(range(1, 7)), seen  # every match length up to K_max = 5
