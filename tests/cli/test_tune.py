"""The tune algorithm on synthetic latency/acceptance, checked against hand computations and
against SpeculativeConfig (the table it writes must be one the config accepts)."""
import json

import pytest

from npuspec.bench import tune
from npuspec.cli import main
from npuspec.config import SpeculativeConfig


def test_expected_tokens_hand_computed():
    a = [0.8, 0.5, 0.25]
    assert tune.expected_tokens(a, 0) == 1.0
    assert tune.expected_tokens(a, 1) == pytest.approx(1.8)
    assert tune.expected_tokens(a, 2) == pytest.approx(1 + 0.8 + 0.4)
    assert tune.expected_tokens(a, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert tune.expected_tokens(a, 5) == pytest.approx(2.3)  # unmeasured positions count as 0


def test_conditional_from_counts_and_rates():
    # 100 request-steps: 80 accepted position 1, 40 position 2, 10 position 3
    assert tune.conditional_acceptance([80, 40, 10], 100) == pytest.approx([0.8, 0.5, 0.25])
    assert tune.conditional_from_unconditional([0.8, 0.4, 0.0, 0.0]) == pytest.approx([0.8, 0.5, 0.0, 0.0])
    # mean acceptance length = 1 + sum of unconditional rates = E(K)
    assert tune.expected_tokens(tune.conditional_from_unconditional([0.8, 0.4, 0.1]), 3) == pytest.approx(2.3)


def test_interpolate():
    pts = {1: 1.0, 3: 2.0, 5: 6.0}
    assert tune.interpolate(pts, 0.5) == 1.0  # flat below
    assert tune.interpolate(pts, 2) == pytest.approx(1.5)
    assert tune.interpolate(pts, 4) == pytest.approx(4.0)
    assert tune.interpolate(pts, 7) == pytest.approx(10.0)  # last slope (2/token) beyond
    assert tune.interpolate({1: 1.0, 2: 0.5}, 4) == 0.5  # never a negative slope


def test_monotone_envelope_and_zero_acceptance():
    noisy = {1: 0.35, 2: 0.16, 3: 0.13, 4: 0.19, 8: 0.24}  # a slow first probe, as seen on a busy CPU
    assert tune.monotone(noisy) == {1: 0.13, 2: 0.13, 3: 0.13, 4: 0.19, 8: 0.24}
    # nothing is ever accepted: speculation cannot win, whatever the noise says
    assert tune.tune_table(noisy, [0.0, 0.0, 0.0], 2) == [[1, 2, 0]]


def test_tokens_per_s_formula():
    lat = {1: 0.010, 8: 0.010, 64: 0.080}  # flat to 8 tokens, then 1.25 ms/token
    a = [0.9, 0.8]
    # B=2, K=1: 4 tokens -> 10 ms; 2 requests * 1.9 tokens
    assert tune.tokens_per_s(lat, a, 2, 1) == pytest.approx(2 * 1.9 / 0.010)
    # with 1 ms of drafting per request-step
    assert tune.tokens_per_s(lat, a, 2, 1, 0.001) == pytest.approx(2 * 1.9 / 0.012)
    # K=0 pays no drafting cost
    assert tune.tokens_per_s(lat, a, 2, 0, 0.001) == pytest.approx(2 / 0.010)
    # host work per request-step is paid at every K
    assert tune.tokens_per_s(lat, a, 2, 0, 0.001, host_s=0.0005) == pytest.approx(2 / 0.011)
    assert tune.tokens_per_s(lat, a, 2, 1, 0.001, host_s=0.0005) == pytest.approx(2 * 1.9 / 0.013)


def test_steps_are_costed_at_their_padded_size():
    sizes = {0: [1, 2, 4, 8], 1: [2, 4, 8, 16]}
    assert tune.step_tokens(3, 0, sizes) == 4 and tune.step_tokens(3, 1, sizes) == 8
    assert tune.step_tokens(9, 1, sizes) == 18  # past the largest size: runs unpadded
    assert tune.step_tokens(3, 0) == 3 and tune.step_tokens(3, 2, sizes) == 9  # no plan for K=2
    lat = {1: 0.001, 2: 0.001, 4: 0.002, 8: 0.002, 16: 0.004}
    # B=3 without speculation really runs 4 rows (2 ms), not the 1.5 ms interpolated at 3 tokens
    assert tune.tokens_per_s(lat, [0.5], 3, 0, sizes=sizes) == pytest.approx(3 / 0.002)
    assert tune.tokens_per_s(lat, [0.5], 3, 0) == pytest.approx(3 / 0.0015)
    # a1 = 0.2: B=3, K=1 pads to 8 tokens (2 ms): 3*1.2/2ms = 1800 beats K=0's real 1500 tok/s;
    # costed unpadded, K=0 would look like 2000 tok/s and win
    assert tune.best_k(lat, [0.2], 3, 1, tolerance=0.0, sizes=sizes)[0] == 1
    assert tune.best_k(lat, [0.2], 3, 1, tolerance=0.0)[0] == 0


def test_best_k_prefers_smaller_within_tolerance():
    lat = {1: 0.01, 1000: 0.01}  # latency flat: every accepted draft is free
    a = [0.9, 0.9, 0.001]
    k, _, tps = tune.best_k(lat, a, 1, 3, tolerance=0.0)
    assert k == 3 and tps[3] > tps[2]
    k, _, _ = tune.best_k(lat, a, 1, 3, tolerance=0.01)  # K=3 gains < 1% over K=2
    assert k == 2


def test_table_compute_bound_drops_k():
    # memory-bound up to 16 tokens, compute-bound (linear) after: K shrinks as batch grows
    lat = {t: 0.002 if t <= 16 else 0.002 * t / 16 for t in (1, 2, 4, 8, 16, 32, 64, 128, 256)}
    a = [0.8, 0.7, 0.6, 0.5]
    table = tune.tune_table(lat, a, 64, 4)
    assert table[0][0] == 1 and table[-1][1] == 64
    for (s0, e0, k0), (s1, e1, k1) in zip(table, table[1:]):
        assert s1 == e0 + 1 and k1 != k0
    ks = [r[2] for r in table]
    assert ks == sorted(ks, reverse=True), table  # K never grows with load here
    assert table[0][2] == 4 and table[-1][2] == 0
    # each chosen K really is the best (hand check at a few batch sizes, zero tolerance)
    for b in (1, 3, 8, 20, 64):
        k = next(r[2] for r in tune.tune_table(lat, a, 64, 4, tolerance=0.0) if r[0] <= b <= r[1])
        tps = [tune.tokens_per_s(lat, a, b, kk) for kk in range(5)]
        assert tps[k] == max(tps)


def test_merge_ranges():
    assert tune.merge_ranges([3, 3, 2, 2, 2, 0]) == [[1, 2, 3], [3, 5, 2], [6, 6, 0]]
    assert tune.merge_ranges([1]) == [[1, 1, 1]]


@pytest.mark.parametrize("acc", [[0.9, 0.8, 0.7, 0.6, 0.5], [0.0, 0.0], [1.0], [0.3]])
def test_tuned_config_accepted_by_speculative_config(acc):
    lat = {t: 0.001 + 1e-5 * t * t for t in (1, 4, 16, 64, 256)}
    table = tune.tune_table(lat, acc, 48)
    d = tune.tuned_config({"method": "ngram", "num_speculative_tokens": 5}, table)
    cfg = SpeculativeConfig.from_dict(d)
    assert [list(r) for r in cfg.num_speculative_tokens_per_batch_size] == table
    for b in range(1, 49):  # the config answers what the tuner chose
        assert cfg.k_for_batch_size(b) == next(r[2] for r in table if r[0] <= b <= r[1])


def test_tune_command_with_given_measurements(tmp_path, capsys):
    lat = tmp_path / "lat.json"
    lat.write_text(json.dumps({"1": 0.002, "16": 0.002, "64": 0.008, "512": 0.064}))
    out = tmp_path / "tune.json"
    rc = main(["tune", "--acceptance", "0.8,0.6,0.4", "--latency-json", str(lat),
               "--max-num-seqs", "32", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    line = [ln for ln in printed.splitlines() if ln.startswith("{")][-1]
    cfg = SpeculativeConfig.from_json(line)  # the printed JSON pastes into --speculative-config
    doc = json.loads(out.read_text())
    assert doc["speculative_config"] == json.loads(line)
    assert cfg.num_speculative_tokens_per_batch_size[0][0] == 1
    assert cfg.num_speculative_tokens_per_batch_size[-1][1] == 32
    assert doc["acceptance"] == pytest.approx([0.8, 0.6, 0.4])


def test_tune_plot(tmp_path):
    pytest.importorskip("matplotlib")
    lat = tmp_path / "lat.json"
    lat.write_text(json.dumps({"1": 0.002, "64": 0.008}))
    png = tmp_path / "t.png"
    assert main(["tune", "--acceptance", "0.7,0.5", "--latency-json", str(lat),
                 "--max-num-seqs", "8", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv,field", [
    (["--acceptance", "0.8,1.5"], "--acceptance"),
    (["--acceptance", "0.8", "--latency-json", "/nonexistent/lat.json"], "--latency-json"),
    (["--acceptance", "0.8", "--tolerance", "2"], "--tolerance"),
    (["--speculative-config", "{\"method\": \"eagle\", \"model\": \"x\", \"num_speculative_tokens\": 2}"],
     "--speculative-config method"),
])
def test_tune_errors(argv, field, capsys):
    assert main(["tune"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err
    assert "Traceback" not in err
