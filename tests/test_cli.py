"""The `tokenmill` command line, run as a subprocess on a tiny model.

`generate` prints the prompt and the same continuation `LLM.generate` gives; `chat` answers each
stdin line with what `LLM.chat` gives for the conversation so far; bad input exits with status 2
and one "tokenmill: error: ..." line naming the problem, never a traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams

TINY_ARGS = ["--dtype", "float32", "--device", "cpu"]
PROMPT = "Once upon a time"


def run_cli(args: list[str], stdin: str = "", console_script: bool = False) -> subprocess.CompletedProcess:
    if console_script:
        script = Path(sys.executable).with_name("tokenmill")
        if not script.is_file():
            pytest.skip(f"no console script next to {sys.executable}")
        command = [str(script), *args]
    else:
        command = [sys.executable, "-m", "tokenmill.cli", *args]
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    result = subprocess.run(command, input=stdin.encode(), capture_output=True, env=env, timeout=300)
    # Bytes -> text without newline translation: the tiny model's output has arbitrary characters.
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode("utf-8"),
                                       result.stderr.decode("utf-8"))


@pytest.fixture(scope="module")
def llama_dir(tiny_hf_model) -> Path:
    return tiny_hf_model("llama")


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), dtype="float32", device="cpu")


def test_generate_prints_prompt_and_the_api_continuation(llama_dir, llm):
    result = run_cli(["generate", PROMPT, "--model", str(llama_dir), "--temperature", "0", "--max-tokens", "8",
                      *TINY_ARGS], console_script=True)
    assert result.returncode == 0, result.stderr
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert len(expected.token_ids) == 8 and expected.text
    assert result.stdout == PROMPT + expected.text + "\n"
    assert "[finish_reason: length]" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_sampling_flags_reach_the_sampler(llama_dir, llm):
    args = ["generate", PROMPT, "--model", str(llama_dir), "--temperature", "0.9", "--top-k", "50", "--top-p",
            "0.95", "--seed", "7", "--max-tokens", "12", "--ignore-eos", *TINY_ARGS]
    result = run_cli(args)
    assert result.returncode == 0, result.stderr
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=7, ignore_eos=True)
    sampled = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].text
    assert sampled != greedy
    assert result.stdout == PROMPT + sampled + "\n"


def test_chat_answers_each_line_until_eof(llama_dir, llm):
    lines = ["hello there", "what now"]
    result = run_cli(["chat", "--model", str(llama_dir), "--temperature", "0", "--max-tokens", "8", *TINY_ARGS],
                     stdin="".join(line + "\n" for line in lines))
    assert result.returncode == 0, result.stderr
    params = SamplingParams(max_tokens=8, temperature=0.0)
    messages, replies = [], []
    for line in lines:
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    assert replies[0] and replies[1] and replies[0] != replies[1]
    # input() writes its "> " prompt to stdout; each reply ends with a newline; EOF ends the chat.
    assert result.stdout == "".join(f"> {r}\n" for r in replies) + "> "
    assert "Traceback" not in result.stderr


MISSING = "{missing}"  # replaced by a path that does not exist
BAD_INPUT = {
    "missing-model": (["generate", "hi", "--model", MISSING], "no-such-model"),
    "chat-missing-model": (["chat", "--model", MISSING], "no-such-model"),
    "negative-temperature": (["generate", "hi", "--temperature", "-1"], "temperature"),
    "top-p-above-1": (["generate", "hi", "--top-p", "2"], "top_p"),
    "zero-max-tokens": (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    "prompt-over-max-model-len": (["generate", "Once upon a time " * 4, "--max-model-len", "8"], "max_model_len"),
    "float16-on-cpu": (["generate", "hi", "--dtype", "float16"], "float16"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_exits_2_with_one_error_line(case, llama_dir, tmp_path):
    args, named = BAD_INPUT[case]
    args = [str(tmp_path / "no-such-model") if a == MISSING else a for a in args]
    if "--model" not in args:
        args = [*args, "--model", str(llama_dir)]
    if "--dtype" not in args:
        args = [*args, "--dtype", "float32"]
    result = run_cli([*args, "--device", "cpu"])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    # Progress bars redraw with "\r": split on it too, as a terminal shows the lines.
    errors = [line for line in re.split(r"[\r\n]", result.stderr) if "error" in line.lower()]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("tokenmill: error: ") and named in errors[0]
    assert result.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_device_without_cuda_exits_2(llama_dir):
    result = run_cli(["generate", "hi", "--model", str(llama_dir), "--device", "cuda"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert re.search(r"^tokenmill: error: device: .*CUDA is not available", result.stderr, re.MULTILINE)
