"""`npuspec bench peers`' parts that need no llama.cpp: the GGUF copies it runs llama.cpp on
(F32: the weights npuspec's loader holds; Q8_0), the precision flag and the ratios."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from npuspec.bench import peers  # noqa: E402
from npuspec.bench.peers_gguf import converted_copy  # noqa: E402
from npuspec.cli_util.errors import UsageError  # noqa: E402

Q = gguf.GGMLQuantizationType


def _source(path):
    """A small GGUF as llama.cpp's quantiser leaves one: a Q4_1 matrix, a Q8_0 matrix, an F32
    norm, and metadata of several types."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.file_type", 3)
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 100000.0)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_string("tokenizer.chat_template", "{{ x }}")
    mats = {"blk.0.attn_q.weight": (Q.Q4_1, rng.standard_normal((8, 64)).astype(np.float32)),
            "token_embd.weight": (Q.Q8_0, rng.standard_normal((16, 64)).astype(np.float32))}
    for name, (qt, x) in mats.items():
        w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tensors(path):
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        x = np.asarray(t.data)
        out[t.name] = (t.tensor_type, x if t.tensor_type == Q.F32
                       else gguf.quants.dequantize(x, t.tensor_type))
    return r, out


def test_f32_copy_holds_the_dequantised_weights_and_the_metadata(tmp_path):
    src = _source(tmp_path / "src.gguf")
    dst = converted_copy(str(src), str(tmp_path / "f32.gguf"), "F32")
    r_src, a = _tensors(src)
    r_dst, b = _tensors(dst)
    assert a.keys() == b.keys()
    for name in a:
        assert b[name][0] == Q.F32, name
        np.testing.assert_array_equal(b[name][1], a[name][1])  # bit-equal to the dequantised
    assert r_dst.fields["general.file_type"].contents() == 0
    for key in ("llama.block_count", "llama.rope.freq_base", "tokenizer.ggml.tokens",
                "tokenizer.chat_template", "general.architecture"):
        assert r_dst.fields[key].contents() == r_src.fields[key].contents(), key
    assert not (tmp_path / "f32.gguf.part").exists()


def test_q8_0_copy_quantises_matrices_and_keeps_norms_f32(tmp_path):
    src = _source(tmp_path / "src.gguf")
    dst = converted_copy(str(src), str(tmp_path / "q8.gguf"), "Q8_0")
    _, a = _tensors(src)
    r, b = _tensors(dst)
    assert b["blk.0.attn_q.weight"][0] == Q.Q8_0 and b["token_embd.weight"][0] == Q.Q8_0
    assert b["blk.0.attn_norm.weight"][0] == Q.F32
    # Q8_0 of a Q8_0 matrix's dequantised values is that matrix again
    np.testing.assert_array_equal(b["token_embd.weight"][1], a["token_embd.weight"][1])
    err = np.abs(b["blk.0.attn_q.weight"][1] - a["blk.0.attn_q.weight"][1]).max()
    assert err < 0.05 * np.abs(a["blk.0.attn_q.weight"][1]).max()
    assert r.fields["general.file_type"].contents() == 7


def test_precisions_flag_and_ratios():
    assert peers._precisions("fp32,q4_1") == ["fp32", "q4_1"]
    for bad in ("", "fp16", "fp32,int3"):
        with pytest.raises(UsageError, match="--precisions"):
            peers._precisions(bad)
    tps = {("npuspec fp32", "plain"): 20.0, ("llama.cpp fp32", "plain"): 40.0,
           ("npuspec bf16", "plain"): 30.0, ("npuspec bf16", "suffix"): 60.0}
    r = peers._ratios(tps)
    assert r == {"npuspec fp32 plain / llama.cpp fp32 plain": 0.5,
                 "npuspec bf16 plain / npuspec fp32 plain": 1.5,
                 "npuspec bf16 suffix / npuspec bf16 plain": 2.0}


def test_a_llama_cpp_that_crashes_on_a_file_loses_its_rows_not_the_run(monkeypatch, tmp_path):
    # llama.cpp runs in-process for the timed rows; a build that dies on a type (SIGILL) is
    # found in a trial process first, and its rows are reported as not run
    seen = []
    monkeypatch.setattr(peers, "llama_fails", lambda f, t: seen.append(f) or "was killed by SIGILL")
    args = peers.build_parser().parse_args(["--precisions", "q4_1", "--no-hf"])
    path = str(_source(tmp_path / "src.gguf"))
    runners, missing = peers._runners(args, path, [[1, 2]], [0], 64, 1, str(tmp_path))
    assert seen == [path]
    assert [r.system for r in runners] == ["npuspec q4_1"] * 3
    assert missing == ["llama.cpp q4_1: not run (llama.cpp was killed by SIGILL evaluating "
                       "src.gguf in a trial process; its build does not run that type on this "
                       "CPU)"]


@pytest.mark.parametrize("code,err,want", [
    (0, "", None), (-4, "", "was killed by SIGILL"), (-11, "", "was killed by SIGSEGV"),
    (1, "Traceback\nValueError: bad file", "exited with status 1 (ValueError: bad file)"),
    (2, "", "exited with status 2")])
def test_trial_failures_are_named(code, err, want):
    assert peers._failure(code, err) == want
