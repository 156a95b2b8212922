"""Two "machines" on 127.0.0.1, one process each: the multi-node path of every sharding family
trains exactly as one machine with two processes does."""

from __future__ import annotations

import json

import pytest

from conftest import free_port, long_test, start
from strategies import matrix_args


# DeepSpeed's own rendezvous and sharded parameters across "machines" (two one-process "machines" in every run:
# tests/test_interruptions.py's elastic job is long; the multi-node config parses in every run).
@pytest.mark.parametrize("config", [pytest.param(config, marks=long_test) for config in ("ddp", "fsdp", "zero3")])
def test_two_machines_train_like_one(config, trained, tmp_path):
    port = str(free_port())
    machines = []
    for rank in ("0", "1"):
        machine = ("--num_machines", "2", "--machine_rank", rank, "--main_process_ip", "127.0.0.1",
                   "--main_process_port", port)
        machines.append(start("lora", tmp_path / f"machine{rank}", *matrix_args("lora", config), config=config,
                              launcher_args=machine))
    outputs = [machine.communicate(timeout=300)[0] for machine in machines]
    assert [machine.returncode for machine in machines] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]

    ran = json.loads((tmp_path / "machine0" / "run.json").read_text())
    one_machine = trained("lora", config)
    assert ran["num_processes"] == 2
    assert ran["distributed_type"] == one_machine.run_json()["distributed_type"]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "machine0" / "metrics.jsonl").read_text().splitlines()
              if '"train"' in line]
    assert losses == pytest.approx(one_machine.losses(), rel=1e-5)
    assert not (tmp_path / "machine1" / "run.json").exists()  # only the main process writes


@long_test
def test_machines_with_their_own_data_caches_each_keep_full_tunings_reference_scores(tmp_path):
    """dpo_full.py on two "machines", each with its own datasets cache (machines without a shared disk): each
    keeps the reference scores the first run computed, and a rerun reads them on both, the same curve. (Were
    the scores kept on the main machine alone, its rerun would read them while the other machine scored the
    pairs again, in collectives only one side joins: a hang.)"""
    def two_machines(name: str) -> list[str]:
        port, machines = str(free_port()), []
        for rank in ("0", "1"):
            machine = ("--num_machines", "2", "--machine_rank", rank, "--main_process_ip", "127.0.0.1",
                       "--main_process_port", port)
            machines.append(start("dpo_full", tmp_path / f"{name}{rank}", "--max-steps", "2", "--batch-size", "2",
                                  "--lr", "1e-3", config="zero3", launcher_args=machine,
                                  env={"HF_DATASETS_CACHE": str(tmp_path / f"datasets-cache{rank}")}))
        outputs = [machine.communicate(timeout=300)[0] for machine in machines]
        assert [machine.returncode for machine in machines] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
        return outputs

    first, again = two_machines("first"), two_machines("again")
    assert "scored by the model as loaded, before training" in first[0] and "scores read from" in again[0]
    for rank in ("0", "1"):  # the training and evaluation pairs' scores, in each machine's own cache
        assert len(list((tmp_path / f"datasets-cache{rank}").rglob("reference-logps-*.npy"))) == 2

    def losses(folder: str) -> list[float]:
        return [json.loads(line)["loss"] for line in (tmp_path / folder / "metrics.jsonl").read_text().splitlines()
                if '"train"' in line]

    assert losses("again0") == losses("first0") and len(losses("first0")) == 2
