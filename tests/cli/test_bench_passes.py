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
