"""`python engine.py generate|chat` as a new user meets it, run as a real process on tiny models.

Oracles: the exit status and stderr (one line, no traceback) for bad input; for --stop, the same
run without the stop string cut where the stop string first occurs; for /save and /load, the
JSON file written after a load equals the one that was loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers

from sampling import SamplingParams
from tests.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def engine(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "engine.py", *args], cwd=ROOT, capture_output=True, text=True,
                          input=stdin, env=env, timeout=300)


@pytest.mark.parametrize("args, names", [
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "0.8", "--top-p", "0"], "top_p"),
    (["--top-p", "2"], "top_p"),
    (["--top-k", "-3"], "top_k"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--kv", "bogus"], "--kv"),
    (["--sink", "-1"], "sink"),
    (["--max-batch", "0"], "max_batch"),
])
def test_bad_arguments_fail_in_one_line_before_the_model_loads(args, names):
    """The model path does not exist: an error about the argument proves it was checked first."""
    run = engine("generate", "--model", "/nonexistent/model", *args, "Hello")
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and names in lines[0], run.stderr


@pytest.mark.parametrize("args", [[""], [], ["--file", "/nonexistent/prompt.txt"], ["--file", "-", "also a prompt"]])
def test_bad_prompts_fail_in_one_line_before_the_model_loads(args):
    run = engine("generate", "--model", "/nonexistent/model", *args, stdin="")
    assert run.returncode != 0 and "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "model" not in lines[0], run.stderr


def test_top_p_zero_is_refused_in_the_python_api_too():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=0.8, top_p=0)


@pytest.fixture(scope="module")
def newline_model(tmp_path_factory) -> Path:
    """A tiny llama whose every token reads as a word and a newline, so that any output holds one."""
    folder = tmp_path_factory.mktemp("newline")
    make_tiny_model("llama", folder)
    vocab = {"[UNK]": 0, **{f"w{i}\n": i for i in range(1, 256)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}assistant"}))
    return folder


def generate_json(model: Path, *args: str) -> dict:
    run = engine("generate", "--model", str(model), "--device", "cpu", "--kv-budget-gb", "0.05", "--json", *args,
                 "w1\n w2\n")
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_escaped_newline_stop_string_stops(newline_model):
    free = generate_json(newline_model, "--max-new-tokens", "12")
    assert "\n" in free["text"] and free["finish_reason"] == "length"
    stopped = generate_json(newline_model, "--max-new-tokens", "12", "--stop", r"\n")  # as a shell passes "\n"
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == free["text"][: free["text"].index("\n")]


def test_json_output_and_stats(newline_model):
    run = engine("generate", "--model", str(newline_model), "--device", "cpu", "--kv-budget-gb", "0.05",
                 "--max-new-tokens", "5", "--stats", "--json", "w1", "w2")
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["w1", "w2"]
    assert all(r["completion_tokens"] == 5 and r["finish_reason"] == "length" for r in rows)
    assert "tok/s" in run.stderr and "bits/element" in run.stderr and "last run" in run.stderr


def test_prompt_from_stdin_equals_the_same_prompt_as_an_argument(newline_model):
    common = ["generate", "--model", str(newline_model), "--device", "cpu", "--kv-budget-gb", "0.05",
              "--max-new-tokens", "6", "--json"]
    from_stdin = engine(*common, "--file", "-", stdin="w3\n w4\n")
    from_arg = engine(*common, "w3\n w4")
    assert from_stdin.returncode == 0 and from_arg.returncode == 0, from_stdin.stderr + from_arg.stderr
    assert json.loads(from_stdin.stdout)["text"] == json.loads(from_arg.stdout)["text"]


def test_chat_save_and_load_round_trip(newline_model, tmp_path):
    saved, again = tmp_path / "chat.json", tmp_path / "again.json"
    script = f"hello\n/save {saved}\n/reset\n/load {saved}\n/save {again}\n/load {tmp_path / 'missing.json'}\n"
    run = engine("chat", "--model", str(newline_model), "--device", "cpu", "--kv-budget-gb", "0.05",
                 "--max-new-tokens", "4", "--system", "be brief", stdin=script)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    conversation = json.loads(saved.read_text())
    assert [m["role"] for m in conversation] == ["system", "user", "assistant"]
    assert conversation[1]["content"] == "hello" and conversation[2]["content"]
    assert json.loads(again.read_text()) == conversation
    assert "error:" in run.stderr  # the missing file: one error line, and the chat went on


def test_a_long_prefill_shows_progress(newline_model):
    run = engine("generate", "--model", str(newline_model), "--device", "cpu", "--kv-budget-gb", "0.05",
                 "--max-new-tokens", "2", "--prefill-chunk", "8", " ".join(f"w{i}" for i in range(1, 60)))
    assert run.returncode == 0, run.stderr
    assert "prefill:" in run.stderr and "/59 [" in run.stderr  # a bar over the prompt's 59 tokens
