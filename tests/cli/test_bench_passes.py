"""`npuspec bench passes`: step times, and the pass manager's compile time per graph."""
import math

from npuspec.bench import passes


def test_rows_report_the_passes_time_per_graph():
    rows = passes.run_case(2, 2, 50, 1, "cpu", "outside",
                           variants=("eager", "npuspec(eager lowering)"))
    eager, ours = rows
    assert eager["backend"] == "eager" and eager["compile_s"] == 0 and eager["passes_s"] == 0
    assert ours["tokens==eager"] == "yes" and ours["patterns_matched"] == 2
    # the pass manager ran on the step's graph (a dry run and the real one) and timed itself
    assert 0 < ours["passes_s"] and ours["compile_s"] >= 0
    assert math.isnan(ours["passes_share"])  # no Inductor row to compare with in this run


def test_the_vllm_v1_step_is_one_composed_call():
    rows = passes.run_case(3, 3, 40, 1, "cpu", "inside",
                           variants=("eager", "npuspec(eager lowering)"), step_name="vllm_v1")
    ours = rows[1]
    assert ours["step"] == "vllm_v1" and ours["tokens==eager"] == "yes"
    # ratio_accept, residual_sample, then the two composed into one call
    assert ours["patterns_matched"] == 3


def test_the_vllm_ascend_step_is_one_ragged_call():
    for draws in ("outside", "inside"):
        rows = passes.run_case(3, 3, 40, 1, "cpu", draws,
                               variants=("eager", "npuspec(eager lowering)"),
                               step_name="vllm_ascend")
        ours = rows[1]
        assert ours["step"] == "vllm_ascend" and ours["tokens==eager"] == "yes"
        # the guarded race (the recovered-token check), then the ragged step around it
        assert ours["patterns_matched"] == 2, ours
        text = passes.manager.HISTORY[-1][2]
        assert "max_spec_len" in text and "residual_sample.default" not in text, text
