"""Targets beyond the template matrix (test_real_templates.py): replies that carry their reasoning,
plain rows under every kind of tokenizer, what the data line says about stop signals and boundaries,
the refusal when no row is left, --chat-template, and one launch under a Qwen3-style template."""

from __future__ import annotations

import json
import sys

import pytest

import chat_fixtures as fixtures
from conftest import REPO, assert_no_traceback_of_ours, launch

sys.path.insert(0, str(REPO / "recipes"))
from common.data import batches, formats, tokens  # noqa: E402
from common.model import modeling  # noqa: E402
from common.refusal import Refusal  # noqa: E402


def tokenised(rows: list[dict], tok, max_length: int = 1 << 16):
    import datasets

    datasets.disable_progress_bars()
    return tokens.tokenize_counted(datasets.Dataset.from_list(rows), tok, max_length)[0]


def trained_text(tok, row: dict) -> str:
    return tok.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != batches.IGNORE])


def with_reasoning(rows: list[dict]) -> list[dict]:
    """Each reply prefixed by a reasoning block, as reasoning models' chat data holds it."""
    return [{"messages": [dict(m, content=f"<think>\nStep {i}: look at it.\n</think>\n\n{m['content']}")
                          if m["role"] == "assistant" else m for i, m in enumerate(row["messages"])]} for row in rows]


@pytest.mark.parametrize("tokenizer_name", fixtures.TOKENIZERS)
def test_qwen3_replies_with_reasoning_keep_every_row_and_train_the_last_reasoning(tokenizer_name):
    """Qwen3's template drops the reasoning of replies before the last user turn and keeps the last
    reply's: every row stays, ids are inference's, and only the rendered reasoning is trained."""
    tok = fixtures.with_template(tokenizer_name, "qwen3")
    rows = with_reasoning(fixtures.chat_rows(16, seed=3))
    out = list(tokenised(rows, tok))
    assert not [row["dropped"] for row in out if row["dropped"]]
    for row, got in zip(rows, out):
        messages = row["messages"]
        assert got["input_ids"] == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
        trained = trained_text(tok, got)
        replies = [m["content"].split("</think>")[-1].strip() for m in messages if m["role"] == "assistant"]
        assert all(reply in trained for reply in replies)
        last = len(messages) - 1
        assert f"Step {last}: look at it." in trained  # the last reply's reasoning is rendered, so trained
        assert not [i for i in range(last) if f"Step {i}:" in trained]  # earlier reasoning is not rendered
        assert trained.count("<|im_end|>") == len(replies)


PLAIN_ROWS = [{"instruction": "Sort these: 3 1 2", "response": "1 2 3"},
              {"instruction": "Reverse:\n\n7 8", "input": "numbers", "output": "Here you go:\n\n8 7"},
              {"prompt": "Question: what is two plus two?\nAnswer:", "completion": " 4"},
              {"prompt": "Say yes. ", "completion": "yes"},
              {"text": "Plain text rows train on every token."}]


@pytest.mark.parametrize("tokenizer_name", fixtures.TOKENIZERS)
@pytest.mark.parametrize("index", range(len(PLAIN_ROWS)))
def test_plain_rows_are_the_whole_text_as_the_tokenizer_writes_it(tokenizer_name, index):
    tok = fixtures.tokenizer(tokenizer_name)
    row = PLAIN_ROWS[index]
    fmt = formats.detect_format(row)
    prompt, target = formats.split_prompt(row, fmt)
    got = tokens.tokenize_row(row, tok, fmt)
    assert got["input_ids"] == tok(prompt + target)["input_ids"] + [tok.eos_token_id]
    trained = trained_text(tok, got)
    assert trained.endswith(tok.eos_token) and got["labels"][-1] == tok.eos_token_id
    assert target.strip() in trained
    if prompt.strip():
        assert prompt.strip() not in trained
        # the tokens before the first target are the prompt's, as inference tokenises the whole text
        first = next(i for i, label in enumerate(got["labels"]) if label != batches.IGNORE)
        assert tok.decode(got["input_ids"][:first], skip_special_tokens=True).strip() in prompt


def test_a_token_across_the_prompt_and_target_is_said_once_and_trained():
    tok = fixtures.tokenizer("byte_level")
    rows = [{"prompt": "Answer: ", "completion": "the answer"}] * 3 + [{"prompt": "Answer:", "completion": " the answer"}]
    out = tokenised(rows, tok)
    assert "in 3 rows one token holds the prompt's end and the target's start" in tokens.counted(out)
    for row in out:  # "Ġthe" holds the prompt's space: the whole text's tokens, the shared one trained
        assert row["input_ids"] == tok("Answer: the answer")["input_ids"] + [tok.eos_token_id]
        assert trained_text(tok, row) == f" the answer{tok.eos_token}"


@pytest.mark.parametrize("family, said", [("solar_instruct", "EOS added after"), ("qwen3", "replies end with <|im_end|>"),
                                          ("gpt_oss", "replies end with <|end|> / <|return|>")])
def test_the_data_line_says_which_stop_signal_replies_get(family, said):
    tok = fixtures.with_template("sentencepiece", family)
    rows = [row for row in fixtures.chat_rows(12, seed=5) if len(row["messages"]) > 3]
    line = tokens.counted(tokenised(rows, tok))
    assert said in line, line


class Args:
    max_length = 1 << 16


@pytest.mark.parametrize("rows, family, fix", [
    ([{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"}]}] * 3, "mistral_instruct", "pass --chat-template FILE"),
    ([{"messages": [{"role": "user", "content": "Hi"}]}] * 3, "qwen3", "map your columns with --columns"),
])
def test_no_row_left_names_the_change_for_its_cause(rows, family, fix):
    tok = fixtures.with_template("byte_level", family)
    with pytest.raises(Refusal) as refused:
        tokens.usable(tokenised(rows, tok), "training", Args())
    message = str(refused.value)
    assert fix in message and "\n" not in message
    assert ("fix the rows" in message) == (fix != "pass --chat-template FILE")


def test_no_row_left_for_length_names_the_length():
    tok = fixtures.with_template("byte_level", "qwen3")
    rows = fixtures.chat_rows(4, seed=2)
    tokenized = tokenised(rows, tok, max_length=8)
    needs = min(tokenized["needs"])
    with pytest.raises(Refusal, match=f"pass --max-length {needs} or more"):
        tokens.usable(tokenized, "training", Args())


def test_chat_template_flag_replaces_the_models_own(tmp_path):
    file = tmp_path / "chatml.jinja"
    file.write_text(fixtures.template("qwen3"))
    tok = modeling.load_tokenizer(str(REPO / "models" / "tiny-llama"), chat_template=str(file))
    assert tok.chat_template == fixtures.template("qwen3")
    with pytest.raises(Refusal, match=r"^--chat-template .*nope.jinja cannot be read \(FileNotFoundError"):
        modeling.load_tokenizer(str(REPO / "models" / "tiny-llama"), chat_template=str(tmp_path / "nope.jinja"))


@pytest.fixture(scope="module")
def qwen3_style_model(tmp_path_factory):
    """A tiny random Llama whose tokenizer is the byte-level fixture with Qwen3's template and tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = fixtures.with_template("byte_level", "qwen3")
    config = json.loads((REPO / "data" / "tiny-llama-config.json").read_text())
    config.update(vocab_size=len(tok), bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    folder = tmp_path_factory.mktemp("qwen3-style")
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_launch_under_a_qwen3_style_template_keeps_every_multi_turn_row(qwen3_style_model, tmp_path):
    """Multi-turn rows with reasoning and tool-calling rows train; --eval-dataset's rows, in TRL's
    conversational prompt-completion layout, are evaluated."""
    rows = with_reasoning(fixtures.chat_rows(64, seed=9))
    assert sum(len(row["messages"]) > 3 for row in rows) > 20
    rows += fixtures.tool_rows(8, seed=1)
    file, held = tmp_path / "chats.jsonl", tmp_path / "prompt_completion.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # TRL's conversational prompt-completion layout: the prompt's turns are context, the completion trains
    conversations = fixtures.chat_rows(8, seed=2)
    held.write_text("".join(json.dumps({"prompt": row["messages"][:-1], "completion": row["messages"][-1:]}) + "\n"
                            for row in conversations))
    run = launch("lora", tmp_path / "out", "--model", str(qwen3_style_model), "--dataset", str(file),
                 "--eval-dataset", str(held), "--max-steps", "2", "--batch-size", "2", "--max-length", "1024",
                 config="ddp")
    assert run.returncode == 0, run.output[-3000:]
    assert_no_traceback_of_ours(run.output)
    line = next(line for line in run.output.splitlines() if line.startswith("data (messages)"))
    assert line.startswith(f"data (messages): training {len(rows)} rows: {len(rows)} used; replies end with <|im_end|>; "
                           "evaluation 8 rows: 8 used; replies end with <|im_end|>"), line
    assert run.metrics("eval")  # the tool-calling rows were evaluated


@pytest.mark.parametrize("tokenizer_name", fixtures.TOKENIZERS)
@pytest.mark.parametrize("family", ["qwen3", "llama3_1", "gpt_oss"])
def test_tool_calls_are_trained_and_tool_results_stay_context(family, tokenizer_name):
    tok = fixtures.with_template(tokenizer_name, family)
    rows = fixtures.tool_rows(6, seed=4)
    out = list(tokenised(rows, tok))
    assert not [row["dropped"] for row in out if row["dropped"]]
    stops = fixtures.stop_ids(tok, family)
    for row, got in zip(rows, out):
        turns = formats.conversation(row["messages"])  # the calls' arguments as objects, as templates take them
        messages = [{key: value for key, value in turn.items() if key != "weight"} for turn in turns]
        assert got["input_ids"] == tok.apply_chat_template(messages, tools=formats.tools_of(row),
                                                           tokenize=True)["input_ids"]
        trained = trained_text(tok, got)
        result = row["messages"][2]["content"]
        assert "largest_of" in trained and row["messages"][3]["content"] in trained
        assert result not in trained and row["messages"][0]["content"] not in trained
        ends = [i for i, (label, following) in enumerate(zip(got["labels"], got["labels"][1:] + [batches.IGNORE]))
                if label != batches.IGNORE and following == batches.IGNORE]
        assert len(ends) == 2 and all(got["input_ids"][i] in stops for i in ends)


def test_tool_rows_train_under_the_default_template_too():
    """A model without a chat template gets the recipes' default one, which writes tool calls as JSON."""
    tok = modeling.load_tokenizer(str(REPO / "models" / "tiny-llama"))
    rows = fixtures.tool_rows(3, seed=8)
    for row, got in zip(rows, tokenised(rows, tok)):
        assert not got["dropped"]
        trained = trained_text(tok, got)
        assert '"name": "largest_of"' in trained and row["messages"][3]["content"] in trained
        assert row["messages"][2]["content"] not in trained and trained.count(tok.eos_token) == 2


# A reply that ends where the next role token starts (as GLM-4's template renders), and nothing after the last
NEXT_ROLE_ENDS_REPLY = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.parametrize("tokenizer_name", fixtures.TOKENIZERS)
def test_the_next_role_token_ends_a_reply_and_eos_ends_the_last(tokenizer_name):
    tok = fixtures.tokenizer(tokenizer_name)
    tok.add_special_tokens({"additional_special_tokens": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"]})
    tok.chat_template = NEXT_ROLE_ENDS_REPLY
    rows = [row for row in fixtures.chat_rows(16, seed=6) if len(row["messages"]) > 3]
    out = list(tokenised(rows, tok))
    assert rows and not [row["dropped"] for row in out if row["dropped"]]
    for row, got in zip(rows, out):
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        ends = [got["input_ids"][i] for i, (label, following) in
                enumerate(zip(got["labels"], got["labels"][1:] + [batches.IGNORE])) if label != batches.IGNORE and following == batches.IGNORE]
        assert tok.convert_ids_to_tokens(ends) == ["<|user|>"] * (len(replies) - 1) + [tok.eos_token]
        assert got["eos_added"] == 1


def test_a_tokenizer_without_offsets_is_refused_in_one_line():
    from common.data import targets

    class SlowTokenizer:
        is_fast = False

    with pytest.raises(Refusal, match=r"^the tokenizer \(SlowTokenizer\) is not a fast \(Rust\) tokenizer, .*tokenizer.json$"):
        targets.tokenize_rows([{"text": "hello"}], SlowTokenizer(), "text")
