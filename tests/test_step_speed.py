"""scripts/measure/step_speed.py, the GPU call's step table, rehearsed on the CPU: every lever that must not change the
numbers gives the defaults' losses (the chunked loss head, the adapters' inputs in bf16), one that changes them
does, and the profile sorts the kernels' time. Its timings on a CPU say nothing of a GPU."""

from __future__ import annotations

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "measure"))


def test_the_step_table_runs_and_the_levers_keep_the_numbers(tmp_path):
    import step_speed

    record = step_speed.main(["--cpu", "--output", str(tmp_path), "--variants",
                              "defaults,before,whole_logits,cast_inputs,dropout,compile", "--profile-steps", "1", "--steps", "6"])
    variants = record["variants"]
    defaults = variants["defaults"]
    assert defaults["loss_path"] == "chunked over the last hidden states"
    assert variants["whole_logits"]["loss_path"].startswith("whole logits")
    assert defaults["last_loss"] != defaults["first_loss"]  # the adapters learnt something to compare
    for name in ("whole_logits", "cast_inputs"):
        assert step_speed.same_numbers(variants[name], defaults), (name, variants[name], defaults)
    assert not step_speed.same_numbers(variants["dropout"], defaults)  # dropout changes the numbers
    assert "skipped" in variants["compile"]
    for name in ("defaults", "before"):
        profile = variants[name]["profile"]
        assert profile["kernel_s"]["matmul"] > 0 and profile["wall_s"] > 0
    table = (tmp_path / "step_speed.md").read_text()
    assert "(DIFFERS)" not in table and table.count("(same numbers)") == 2
    assert record["planner"]["peak_gib"] > 0 and record["planner"]["epoch_s_one_gpu_projected"] > 0
