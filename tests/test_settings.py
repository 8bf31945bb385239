"""One declaration per engine setting (EngineConfig), and the command line built from it.

Every EngineConfig field with a flag is a flag of every engine command, with EngineConfig's
default; flags -> engine_args -> EngineConfig and flags -> engine_argv -> flags round-trip; sizes
such as 4GiB; --log-level before or after the command; --threads; --chat-template; models by
Hugging Face id from a pre-populated hub cache (no hub is reachable here, nor needed).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams, TokenmillError
from tokenmill.cli import build_parser, main
from tokenmill.config import EngineConfig, engine_args, engine_argv, parse_size

ENGINE_COMMANDS = [["generate", "x"], ["chat"], ["serve"], ["bench", "latency"], ["bench", "throughput"],
                   ["bench", "roofline"], ["bench", "serve"], ["bench", "compare"]]
CLI_FIELDS = [f for f in dataclasses.fields(EngineConfig) if f.metadata["cli"]]


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=" ".join)
def test_every_engine_setting_is_a_flag_of_every_engine_command(command):
    args = build_parser().parse_args(command)
    for f in CLI_FIELDS:
        assert hasattr(args, f.name), f"{' '.join(command)} has no --{f.name.replace('_', '-')}"
    defaults = {f.name: f.default for f in CLI_FIELDS if f.name != "model"}
    overridden = {"bench throughput": {"max_num_seqs"}, "bench compare": {"threads"}}.get(" ".join(command), set())
    assert {k: v for k, v in engine_args(args).items() if k not in overridden} == \
        {k: v for k, v in defaults.items() if k not in overridden}


def test_flags_round_trip_through_engine_args_and_engine_argv():
    argv = ["--dtype", "float32", "--threads", "1", "--max-num-seqs", "8", "--kv-cache-memory", "64MiB",
            "--no-enable-prefix-caching", "--attention-backend", "torch", "--quantization", "none",
            "--chat-template", "{{ messages }}", "--tokenizer", "some/where"]
    args = build_parser().parse_args(["serve", *argv])
    values = engine_args(args)
    config = EngineConfig(**values)
    assert config.kv_cache_memory == 64 << 20 and config.threads == 1 and config.enable_prefix_caching is False
    again = build_parser().parse_args(["serve", *engine_argv(args)])
    assert engine_args(again) == values
    assert engine_argv(build_parser().parse_args(["serve"])) == []


@pytest.mark.parametrize(("text", "expected"), [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("2G", 2 << 30),
                                                ("1.5g", 3 << 29), ("1000", 1000), ("3 MB", 3 * 10**6),
                                                ("16KiB", 16384)])
def test_sizes(text, expected):
    assert parse_size("kv_cache_memory", text) == expected
    assert EngineConfig(kv_cache_memory=text).kv_cache_memory == expected


@pytest.mark.parametrize("text", ["4XB", "GiB", "-1GiB", "1e9", ""])
def test_bad_sizes_name_the_setting(text):
    with pytest.raises(TokenmillError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory=text)


def test_bad_size_on_the_command_line_is_one_line(capsys):
    assert main(["generate", "x", "--kv-cache-memory", "4 gigs"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("tokenmill: error: kv_cache_memory") and "Traceback" not in err


def test_log_level_before_or_after_the_command():
    parser = build_parser()
    assert parser.parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "ERROR", "serve"]).log_level == "ERROR"
    assert parser.parse_args(["bench", "serve", "--log-level", "warning"]).log_level == "WARNING"
    assert parser.parse_args(["serve"]).log_level == "INFO"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--log-level", "LOUD"])


def test_threads_sets_the_engines_thread_count(tiny_hf_model):
    LLM(str(tiny_hf_model("llama")), dtype="float32", threads=1)   # (conftest puts the count back)
    assert torch.get_num_threads() == 1
    with pytest.raises(TokenmillError, match="threads"):
        EngineConfig(threads=0)
    # (100000 once crashed the process inside OpenMP's runtime)
    with pytest.raises(TokenmillError, match="threads must be at most 512, got 100000"):
        EngineConfig(threads=100_000)


@pytest.mark.parametrize("setting", ["model", "tokenizer", "chat_template"])
def test_empty_paths_are_refused(setting):
    with pytest.raises(TokenmillError, match=f"{setting} must not be empty"):
        EngineConfig(**{setting: " "})


def test_a_kv_pool_larger_than_the_machine_is_refused_before_allocation(tiny_hf_model):
    """The pool is reserved untouched: one that can never be resident would pass the load and fail
    once requests filled it (10^12 blocks once raised MemoryError from the block list)."""
    path = str(tiny_hf_model("llama"))
    with pytest.raises(TokenmillError, match=r"num_kv_blocks: 1000000000000 blocks .* more than the cpu memory"):
        LLM(path, dtype="float32", num_kv_blocks=10**12)
    with pytest.raises(TokenmillError, match=r"kv_cache_memory: 10240.0 GiB is more than the cpu memory"):
        LLM(path, dtype="float32", kv_cache_memory="10TiB")
    # and one smaller than a block (a size without its unit) was rounded up to one block
    with pytest.raises(TokenmillError, match=r"kv_cache_memory: 100 bytes is less than one KV block \(\d+ bytes"):
        LLM(path, dtype="float32", kv_cache_memory=100)


def test_a_tokenizer_with_more_tokens_than_the_model_is_refused(tiny_hf_model, default_gguf_path):
    with pytest.raises(TokenmillError, match=r"tokenizer: .* has 49152 tokens, more than the model's vocabulary"):
        LLM(str(tiny_hf_model("llama")), dtype="float32", tokenizer=str(default_gguf_path))


def test_chat_template_as_a_string_or_a_file(tiny_hf_model, tmp_path):
    path = str(tiny_hf_model("llama"))
    messages = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}[go]"
    llm = LLM(path, dtype="float32", chat_template=template)
    assert llm.chat_prompt(messages, True)[0] == "<user>hi[go]"
    (tmp_path / "t.jinja").write_text(template.replace("[go]", "[file]"), encoding="utf-8")
    llm = LLM(path, dtype="float32", chat_template=str(tmp_path / "t.jinja"))
    assert llm.chat_prompt(messages, True)[0] == "<user>hi[file]"
    with pytest.raises(TokenmillError, match="chat_template.*neither a file nor"):
        LLM(path, dtype="float32", chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(TokenmillError, match="not valid Jinja"):
        LLM(path, dtype="float32", chat_template="{% for %}")
    # templates that compile but cannot render are refused at load too (they were every chat's 400,
    # which blamed the client's messages for the server's setting)
    (tmp_path / "empty.jinja").write_text("", encoding="utf-8")
    for bad, words in (('{{ raise_exception("boom") }}', "the chat_template setting failed: boom"),
                       ("{{ messages[0].nosuch.attr }}", "the chat_template setting failed: .*nosuch"),
                       (str(tmp_path / "empty.jinja"), "renders a conversation as no text")):
        with pytest.raises(TokenmillError, match=f"{words}.*tried at load"):
            LLM(path, dtype="float32", chat_template=bad)
    # one that requires a system message first is taken
    system_first = ("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
                    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    llm = LLM(path, dtype="float32", chat_template=system_first)
    assert llm.chat_prompt([{"role": "system", "content": "s"}, *messages], True)[0] == "<system>s<user>hi"


# ---- Hugging Face ids, from a hub cache laid out by hand ------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo: str, files: dict[str, Path]) -> None:
    """Lay out `repo` in a huggingface_hub cache as a download leaves it (refs/main -> a snapshot)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        if src.is_dir():
            shutil.copytree(src, snapshot / name, dirs_exist_ok=True)
        else:
            shutil.copy(src, snapshot / name)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_hf_model, tiny_gguf_model) -> Path:
    cache = tmp_path_factory.mktemp("hub")
    cache_repo(cache, "tiny-org/tiny-llama", {".": tiny_hf_model("llama")})
    cache_repo(cache, "tiny-org/tiny-llama-GGUF", {"tiny-llama-Q4_1.gguf": tiny_gguf_model("llama", "Q4_1"),
                                                   "tiny-llama-Q8_0.gguf": tiny_gguf_model("llama", "Q8_0")})
    return cache


def run_cli(cache: Path, *argv: str, offline: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1" if offline else "0"}
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *argv], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.parametrize("model", ["tiny-org/tiny-llama", "tiny-org/tiny-llama-GGUF:Q8_0",
                                   "tiny-org/tiny-llama-GGUF:q4_1", "tiny-org/tiny-llama-GGUF/tiny-llama-Q8_0.gguf"])
def test_hub_ids_load_from_the_cache(hub_cache, tiny_hf_model, model):
    r = run_cli(hub_cache, "generate", "Hello", "--model", model, "--max-tokens", "4", "--temperature", "0",
                "--ignore-eos", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    reference = LLM(str(tiny_hf_model("llama")), dtype="float32").generate(
        "Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    if ":" not in model and not model.endswith(".gguf"):   # the same weights unquantized: the same text
        assert r.stdout.strip() == ("Hello" + reference).strip()
    assert "[finish_reason: length]" in r.stderr


@pytest.mark.parametrize(("model", "words"), [
    ("tiny-org/not-cached", ["tiny-org/not-cached", "not in the local Hugging Face cache", "HF_HUB_OFFLINE"]),
    # a cached snapshot without the asked file is no hit (offline: then not in the cache)
    ("tiny-org/tiny-llama-GGUF:Q5_K", ["tiny-org/tiny-llama-GGUF", "not in the local Hugging Face cache"]),
    ("tiny-org/tiny-llama-GGUF/other.gguf", ["tiny-org/tiny-llama-GGUF", "not in the local Hugging Face cache"]),
    ("tiny-org/tiny-llama-GGUF/tiny-llama-Q8_0.gguf/x", ["model path does not exist"]),   # no id: a path
    ("tiny-org/tiny-llama-GGUF:tiny", ["exactly one GGUF", "tiny-llama-Q4_1.gguf", "tiny-llama-Q8_0.gguf"]),
])
def test_hub_id_errors_are_one_line(hub_cache, model, words):
    r = run_cli(hub_cache, "generate", "Hello", "--model", model, "--max-tokens", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenmill: error: model") and all(w in last for w in words), last


@pytest.mark.parametrize(("setting", "value"), [("enable_prefix_caching", "no"), ("model", 123),
                                                ("chat_template", ["x"]), ("enable_chunked_prefill", 1)])
def test_settings_of_the_wrong_type_name_themselves(setting, value):
    with pytest.raises(TokenmillError, match=setting):
        EngineConfig(**{setting: value})


def test_python_values_for_paths_dtypes_and_devices_are_taken(tiny_hf_model):
    """A Path, torch.float32 and torch.device("cpu") were refused ("must be str") though they name
    what the strings do."""
    config = EngineConfig(model=tiny_hf_model("llama"), dtype=torch.float32, device=torch.device("cpu"))
    assert (config.model, config.dtype, config.device) == (str(tiny_hf_model("llama")), "float32", "cpu")
    llm = LLM(tiny_hf_model("llama"), dtype=torch.bfloat16, device=torch.device("cpu"))
    assert llm.engine.dtype == torch.bfloat16 and llm.engine.device == torch.device("cpu")
