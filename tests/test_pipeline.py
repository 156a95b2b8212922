"""Pipeline parallel (`--pipeline-stages N` on accelerate_configs/pipeline.yaml), through the real
`accelerate launch` on CPU processes: the same seed and global batch give one process's loss curve,
evaluation and trained weights, under 1F1B, GPipe and interleaved 1F1B (two parts of the layers per
process), with pipelines replicated (2 stages x 2 replicas);
the export holds every stage's layers; a resumed run continues the same curve; what cannot run is one
line before the model loads."""

from __future__ import annotations

import os
import sys
from unittest import mock

import pytest

from conftest import REPO, assert_the_refusal_ends_the_output, launch, long_test

sys.path.insert(0, str(REPO / "recipes"))
from common.launching import preflight  # noqa: E402
from common.launching.args import parse_args, recipe_flags  # noqa: E402
from common.launching.launch import DDP, FSDP, Launch  # noqa: E402
from common.model.pipeline_layout import PipelineLayout  # noqa: E402
from common.launching.preflight import Refusal  # noqa: E402

STEPS, GRAD_ACCUM, SAVE_EVERY = 3, 4, 2


def test_the_layers_go_to_contiguous_stages_the_first_ones_one_more():
    for layers, stages in ((22, 4), (2, 2), (48, 3), (7, 7)):
        ranges = [PipelineLayout(stages, 1, 0, layers).layer_range(s) for s in range(stages)]
        assert [i for r in ranges for i in r] == list(range(layers))
        sizes = [len(r) for r in ranges]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    layout = PipelineLayout(2, 2, 3, 22)  # rank 3: the second pipeline's last stage
    assert (layout.replica, layout.stage, layout.is_first, layout.is_last) == (1, 1, False, True)


def test_interleaved_processes_run_every_stages_th_part():
    """Under the interleaved schedule, 2 stages x 3 parts each: process s runs parts s, s + 2, s + 4 of the
    layers, the first holding the embedding and the last the head."""
    layouts = [PipelineLayout(2, 2, rank, 13, chunks=3) for rank in range(4)]
    assert [layout.parts_of() for layout in layouts[:2]] == [[0, 2, 4], [1, 3, 5]]
    assert sorted(i for layout in layouts[:2] for i in layout.held_layers()) == list(range(13))
    assert layouts[0].held_layers() == [0, 1, 2, 5, 6, 9, 10]  # parts of 3, 2, 2, 2, 2, 2 layers
    assert [layouts[3].rank_of(part) for part in range(6)] == [2, 3, 2, 3, 2, 3]  # in the second pipeline
    assert layouts[0].is_first and layouts[1].is_last and layouts[3].is_last


# name: recipe, schedule, replicas, extra flags. Every suite run launches the first; the others are long
# tests (results/2026-11-26_cpu_pipeline/ holds their run): both recipes under every schedule, each recipe
# with one pipeline and with two replicas. The interleaved cases train a 4-layer model (2 stages x 2 parts).
CASES = {"lora-interleaved": ("lora", "interleaved", 1, ["--packing"]),
         "lora-1f1b": ("lora", "1f1b", 1, ["--packing"]), "full-gpipe-replicated": ("full", "gpipe", 2, []),
         "full-1f1b": ("full", "1f1b", 1, []), "lora-gpipe-replicated": ("lora", "gpipe", 2, []),
         "full-interleaved-replicated": ("full", "interleaved", 2, [])}
EVERY_RUN = "lora-interleaved"


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """The bundled tiny Llama's shape with 4 decoder layers (random weights), beside its tokenizer."""
    import json

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from conftest import TINY_MODEL

    folder = tmp_path_factory.mktemp("four-layers")
    config = json.loads((REPO / "data" / "tiny-llama-config.json").read_text()) | {"num_hidden_layers": 4}
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, four_layers):
    """`runs(recipe)`: (one process, the pipeline) with the same seed and global batch, launched once."""
    done = {}

    def run(case: str):
        if case not in done:
            recipe, schedule, replicas, extra = CASES[case]
            folder = tmp_path_factory.mktemp(f"pipeline-{case}")
            model = ["--model", str(four_layers)] if schedule == "interleaved" else []
            common = ["--max-steps", str(STEPS), "--grad-accum", str(GRAD_ACCUM), "--log-every", "1", *extra,
                      *model, "--save-every", str(SAVE_EVERY)]
            common += ["--lr", "2e-3"] if recipe == "full" else ["--lr", "5e-3", "--lora-dropout", "0"]
            one = launch(recipe, folder / "one", *common, "--batch-size", str(2 * replicas), processes=1)
            assert one.returncode == 0, one.output[-3000:]
            piped = launch(recipe, folder / "pipeline", *common, "--batch-size", "2", "--pipeline-stages", "2",
                           "--pipeline-schedule", schedule, config="pipeline", processes=2 * replicas)
            assert piped.returncode == 0, piped.output[-3000:]
            done[case] = one, piped, common
        return done[case]

    return run


@pytest.mark.parametrize("case", [pytest.param(case, marks=() if case == EVERY_RUN else long_test) for case in CASES])
def test_stages_train_as_one_process(case, runs):
    """Packed rows (their position_ids) and padded rows (their attention mask) reach every stage."""
    import torch
    from safetensors.torch import load_file

    recipe, schedule, replicas, _ = CASES[case]
    one, piped, _ = runs(case)
    assert len(piped.losses()) == STEPS
    assert piped.losses() == pytest.approx(one.losses(), rel=1e-5)
    assert piped.metrics("eval")[-1]["eval_loss"] == pytest.approx(one.metrics("eval")[-1]["eval_loss"], rel=1e-5)
    record = piped.run_json()
    parts = 2 if schedule == "interleaved" else 1
    assert record["pipeline"] == {"stages": 2, "replicas": replicas, "schedule": schedule, "chunks": parts,
                                  "micro_batches": GRAD_ACCUM, "bubble": round(1 / (parts * GRAD_ACCUM + 1), 4),
                                  "layers_by_stage": [[i, i] for i in range(2 * parts)],
                                  "rank_layout": "rank = replica * stages + stage" + (
                                      "; stage s runs parts s, s + stages, ..." if parts > 1 else "")}
    assert record["launch"]["pipeline_stages"] == 2 and record["batch"]["global_batch_size"] == 2 * GRAD_ACCUM * replicas
    assert f"pipeline: 2 stages x {replicas} replica(s), {schedule}, 4 micro-batches per step" in piped.output
    # the export holds every stage's tensors (each rank held half the layers), trained as one process trained them
    name = "model/model.safetensors" if recipe == "full" else "adapter/adapter_model.safetensors"
    ours, theirs = load_file(piped.output_dir / name), load_file(one.output_dir / name)
    assert set(ours) == set(theirs) and any(f".layers.{2 * parts - 1}." in key for key in ours)
    probe = load_file(piped.output_dir / "probe_logits.safetensors")  # the trained stages' logits
    from transformers import AutoModelForCausalLM

    if recipe == "full":
        model = AutoModelForCausalLM.from_pretrained(piped.output_dir / "model")
    else:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(piped.run_json()["base_model"])
        model = PeftModel.from_pretrained(base, piped.output_dir / "adapter")
    with torch.no_grad():  # the saved files compute what the stages computed
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    assert torch.allclose(logits, probe["logits"], atol=1e-5)
    # the sample answers, token by token through the stages, are the ones generate() gave one process
    samples = (piped.output_dir / "samples.jsonl").read_text().splitlines()
    assert len(samples) == 3 and samples == (one.output_dir / "samples.jsonl").read_text().splitlines()

def test_a_resumed_pipeline_continues_the_same_curve(runs, tmp_path):
    """Each stage's weights and optimizer state (read by name), the schedule and every rank's random state
    come back."""
    import shutil

    _, piped, common = runs(EVERY_RUN)
    saved = piped.output_dir / "checkpoints" / f"step-{SAVE_EVERY}"
    assert sorted(p.name for p in (saved / "pipeline_stages").iterdir()) == ["stage-0.pt", "stage-1.pt"]
    shutil.copytree(saved, tmp_path / "resumed" / "checkpoints" / saved.name)
    resumed = launch("lora", tmp_path / "resumed", *common, "--batch-size", "2", "--pipeline-stages", "2",
                     "--pipeline-schedule", "interleaved", "--resume", "auto", config="pipeline", processes=2)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert [r["step"] for r in resumed.metrics()] == list(range(SAVE_EVERY + 1, STEPS + 1))
    assert resumed.losses() == piped.losses()[SAVE_EVERY:]


@long_test
@pytest.mark.parametrize("written", ["pipeline", "one"])
def test_a_checkpoint_crosses_between_a_pipeline_and_one_process(written, runs, tmp_path):
    """The interleaved pipeline's checkpoint continues on one process, and one process's under the pipeline
    (each stage takes its layers by name), on the same curve."""
    import shutil

    one, piped, common = runs(EVERY_RUN)
    source = piped if written == "pipeline" else one
    saved = source.output_dir / "checkpoints" / f"step-{SAVE_EVERY}"
    shutil.copytree(saved, tmp_path / "checkpoints" / saved.name)
    if written == "pipeline":
        resumed = launch("lora", tmp_path, *common, "--batch-size", "2", "--resume", "auto", processes=1)
    else:
        resumed = launch("lora", tmp_path, *common, "--batch-size", "2", "--pipeline-stages", "2",
                         "--pipeline-schedule", "interleaved", "--resume", "auto", config="pipeline", processes=2)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "its trained state is read parameter by parameter into this launch" in resumed.output
    assert resumed.losses() == pytest.approx(source.losses()[SAVE_EVERY:], rel=1e-5)


def args_of(*argv: str, recipe: str = "lora"):
    return parse_args(recipe_flags(recipe), list(argv))


def plain(processes: int, kind: str = DDP) -> Launch:
    return Launch(kind, processes=processes, on_gpu=False, visible_gpus=0, precision="no")


@pytest.mark.parametrize("argv, launched, message", [
    (["--pipeline-stages", "3"], plain(4), "--pipeline-stages 3 does not divide the 4 processes"),
    (["--pipeline-stages", "4"], plain(4), "--pipeline-stages 4 is more than the model's 2 decoder layers"),
    (["--pipeline-stages", "2"], plain(2, FSDP), "--pipeline-stages runs on a plain multi-process launch "
                                                 r"\(accelerate_configs/pipeline.yaml\), not on fsdp"),
    (["--pipeline-stages", "2", "--liger"], plain(2), "--liger's kernels are not patched into pipeline stages"),
    (["--pipeline-stages", "0"], plain(2), "--pipeline-stages must be >= 1"),
    (["--pipeline-stages", "2", "--pipeline-schedule", "interleaved"], plain(2),
     "--pipeline-stages 2 x --pipeline-chunks 2 cuts the model's 2 decoder layers into 4 parts, more than there "
     "are: too few to interleave: use --pipeline-schedule 1f1b"),
])
def test_what_a_pipeline_cannot_run_is_one_line(argv, launched, message):
    with pytest.raises(Refusal, match=message):
        preflight.check_pipeline(args_of(*argv), "lora", launched)


def test_one_f_one_b_needs_a_micro_batch_per_stage():
    staged = preflight.check_pipeline(args_of("--pipeline-stages", "2"), "full", plain(4))
    with pytest.raises(Refusal, match="1F1B needs at least as many micro-batches per step as stages: --grad-accum 2 "
                                      r"or more \(with 4 each stage idles 20% of a step\), or --pipeline-schedule gpipe"):
        preflight.check_pipeline_micro_batches(args_of("--pipeline-stages", "2", "--grad-accum", "1"), staged)
    preflight.check_pipeline_micro_batches(args_of("--pipeline-stages", "2", "--grad-accum", "2"), staged)
    preflight.check_pipeline_micro_batches(args_of("--pipeline-stages", "2", "--pipeline-schedule", "gpipe"), staged)


def test_interleaved_needs_rounds_of_one_micro_batch_per_stage():
    staged = preflight.check_pipeline(args_of("--pipeline-stages", "2"), "full", plain(4))
    with pytest.raises(Refusal, match="the interleaved schedule runs rounds of one micro-batch per stage: "
                                      r"--grad-accum 4 \(a multiple of the 2 stages, not 5\)"):
        preflight.check_pipeline_micro_batches(args_of("--pipeline-stages", "2", "--pipeline-schedule", "interleaved",
                                                       "--grad-accum", "5"), staged)
    preflight.check_pipeline_micro_batches(args_of("--pipeline-stages", "2", "--pipeline-schedule", "interleaved",
                                                   "--grad-accum", "6"), staged)


def test_a_model_the_split_cannot_cut_is_named():
    """The split needs embed_tokens, a list of layers and a norm; and a decoder whose forward takes the
    previous stage's hidden states unchanged (one that scales its input embeddings would scale twice)."""
    from types import SimpleNamespace

    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.model.pipeline_layout import split_changes_the_forward, unstageable

    with init_empty_weights():
        gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=2))
        opt = AutoModelForCausalLM.from_config(AutoConfig.for_model("opt", num_hidden_layers=2))
    assert unstageable(gpt2) == "GPT2Model has no embed_tokens, layers, norm, layers as a list"
    assert unstageable(opt) == "OPTDecoder has no norm"

    class Decoder(torch.nn.Module):
        def __init__(self, scale: float):
            super().__init__()
            self.embed_tokens, self.layers, self.scale = torch.nn.Embedding(8, 4), torch.nn.ModuleList([]), scale
            self.norm = torch.nn.LayerNorm(4)

        def forward(self, input_ids=None, inputs_embeds=None, use_cache=False):
            hidden = (self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds) * self.scale
            for layer in self.layers:
                hidden = layer(hidden)
            return SimpleNamespace(last_hidden_state=self.norm(hidden))

    class LM(torch.nn.Module):
        def __init__(self, scale: float = 1.0, softcap: float = 0.0):
            super().__init__()
            self.decoder, self.lm_head, self.softcap = Decoder(scale), torch.nn.Linear(4, 8), softcap

        def forward(self, input_ids, use_cache=False):
            logits = self.lm_head(self.decoder(input_ids).last_hidden_state)
            return SimpleNamespace(logits=torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits)

    def problem(lm):
        return split_changes_the_forward(lm, lm.decoder)

    assert problem(LM()) is None
    assert "changes the input embeddings" in problem(LM(scale=2.0))
    assert "a softcap or scale follows the head" in problem(LM(softcap=5.0))
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64,
                                                                  num_attention_heads=4, num_hidden_layers=2))
    assert split_changes_the_forward(llama, llama.get_decoder()) is None


def test_one_stage_is_no_pipeline():
    assert preflight.check_pipeline(args_of(), "lora", plain(2)) == plain(2)
    staged = preflight.check_pipeline(args_of("--pipeline-stages", "2"), "lora", plain(4))
    assert staged.pipeline_stages == 2 and staged.data_parallel_size == 2
    assert staged.name == "2-stage pipeline x 2 replica(s)"


@long_test  # (tests/test_bad_input.py checks the refusal's place through the launcher in every run)
def test_a_refused_pipeline_ends_the_launchers_output(tmp_path):
    with mock.patch.dict(os.environ):
        run = launch("lora", tmp_path / "out", "--pipeline-stages", "3", "--max-steps", "1", config="pipeline",
                     processes=3)
    refusal = "error: --pipeline-stages 3 is more than the model's 2 decoder layers: use at most 2"
    assert run.returncode != 0
    assert_the_refusal_ends_the_output(run.output, refusal)
    assert "model: loading the weights" not in run.output  # before the model loads


def test_check_config_answers_for_a_pipeline():
    """scripts/check_config.py runs the same checks on pipeline.yaml with the recipe's flags."""
    sys.path.insert(0, str(REPO / "scripts"))
    import check_config

    config = REPO / "accelerate_configs" / "pipeline.yaml"
    lines = check_config.check(config, "lora", ["--pipeline-stages", "2", "--grad-accum", "4"], on_gpu=True)
    assert lines[-1] == "ok: lora runs as 2-stage pipeline x 2 replica(s) on 4 process(es), precision bf16"
    with pytest.raises(Refusal, match="--pipeline-stages 3 does not divide the 4 processes"):
        check_config.check(config, "lora", ["--pipeline-stages", "3"], on_gpu=True)


@pytest.mark.parametrize("dtype_name, shard", [("float32", "200KB"), ("bfloat16", None)])
def test_a_stage_reads_its_own_weights_as_the_whole_model_loads_them(dtype_name, shard, tmp_path, four_layers):
    """Each process reads only its stage's tensors from the files (sharded or not): the same parameters,
    buffers, dtypes and config as the whole model loaded and then cut."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.model.pipeline_layout import keep_stage
    from common.model.model_config import empty_model
    from common.model.stage_loading import load_stage

    name = four_layers
    if shard:  # the same weights in several files named by an index
        AutoModelForCausalLM.from_pretrained(four_layers).save_pretrained(tmp_path, max_shard_size=shard)
        name = tmp_path
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    dtype = getattr(torch, dtype_name)
    config = AutoConfig.from_pretrained(name)
    for rank in range(4):  # 2 stages x 2 parts (interleaved), both replicas
        layout = PipelineLayout(2, 2, rank, 4, chunks=2)
        whole = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, use_safetensors=True)
        keep_stage(whole, layout)
        staged, why = load_stage(str(name), empty_model(config), layout, dtype)
        assert why is None
        for kind in ("named_parameters", "named_buffers"):
            theirs, ours = dict(getattr(whole, kind)()), dict(getattr(staged, kind)())
            assert ours.keys() == theirs.keys()
            for key, tensor in ours.items():
                assert tensor.dtype == theirs[key].dtype and torch.equal(tensor, theirs[key]), key
        held = {int(key.split(".")[2]) for key in dict(staged.named_parameters()) if ".layers." in key}
        assert held == set(layout.held_layers()) == ({0, 2} if rank % 2 == 0 else {1, 3})
        assert staged.config.to_dict() == whole.config.to_dict() and not staged.training


def test_a_model_with_tied_weights_loads_whole_then_is_cut(tmp_path):
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from common.model.model_config import empty_model
    from common.model.stage_loading import load_stage

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, tie_word_embeddings=True)).save_pretrained(tmp_path)
    model, why = load_stage(str(tmp_path), empty_model(AutoConfig.from_pretrained(tmp_path)),
                            PipelineLayout(2, 1, 1, 2), torch.float32)
    assert model is None and why == "its LM head is its embedding (tied)"


def _generate_worker(rank: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.training.pipeline import Pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.tensor([[5, 9, 3, 17]])
    with torch.no_grad():
        expected = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                  do_sample=False)
    pipe = Pipeline(model, PipelineLayout(2, 1, rank, 4, chunks=2), torch.device("cpu"), "interleaved", 2, 0)
    queue.put((rank, pipe.generate(prompt, 12, []).tolist(), expected.tolist()))
    dist.destroy_process_group()


def test_greedy_answers_through_the_stages_are_generates():
    """The sample answers under a pipeline: each token picked on the last part and told to every stage, as
    transformers' greedy generate (with its KV cache) picks them in one process."""
    import torch.multiprocessing as mp

    from conftest import free_port

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = free_port()
    workers = [context.Process(target=_generate_worker, args=(rank, port, queue)) for rank in range(2)]
    for worker in workers:
        worker.start()
    results = [queue.get() for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    expected = results[0][2]
    assert len(expected[0]) == 4 + 12 and len(set(expected[0][4:])) > 1  # a varied answer, not one token repeated
    assert [tokens for _, tokens, _ in results] == [expected, expected]


FAMILIES = {  # transformers' config class and what its family adds to the Llama layout
    "qwen2": ("Qwen2", {}),  # biases on q, k, v
    "mistral": ("Mistral", {"sliding_window": 64}),
    "phi3": ("Phi3", {}),  # fused qkv and gate_up projections
    "qwen3": ("Qwen3", {"head_dim": 16}),  # q and k norms
    "gemma": ("Gemma", {"head_dim": 16}),  # scaled embeddings, (1 + weight) norms
}


@long_test
@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_train_in_interleaved_stages_as_one_process(family, tmp_path):
    """Each family's own forward runs in the stages (read from the files stage by stage): LoRA on packed rows,
    2 stages x 2 parts of a 4-layer model, the same losses and evaluation as one process."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from conftest import TINY_MODEL

    name, extra = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    config = getattr(transformers, f"{name}Config")(
        vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=3, hidden_size=64,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)
    getattr(transformers, f"{name}ForCausalLM")(config).save_pretrained(tmp_path / family)
    tokenizer.save_pretrained(tmp_path / family)
    common = ["--model", str(tmp_path / family), "--max-steps", "3", "--grad-accum", "4", "--log-every", "1",
              "--lr", "5e-3", "--lora-dropout", "0", "--packing", "--batch-size", "2"]
    one = launch("lora", tmp_path / "one", *common, processes=1)
    piped = launch("lora", tmp_path / "pipeline", *common, "--pipeline-stages", "2", "--pipeline-schedule",
                   "interleaved", config="pipeline", processes=2)
    assert one.returncode == 0 and piped.returncode == 0, (one.output[-2000:], piped.output[-2000:])
    assert "every process loads the whole model" not in piped.output  # each read its stage alone
    assert piped.losses() == pytest.approx(one.losses(), rel=1e-5) and len(piped.losses()) == 3
    assert piped.metrics("eval")[-1]["eval_loss"] == pytest.approx(one.metrics("eval")[-1]["eval_loss"], rel=1e-5)
