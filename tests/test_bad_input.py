"""Bad input raises a `TokenmillError` subclass whose message names the file or field.

Checkpoints: missing, empty or foreign folders, pickle-only folders, unsupported architectures,
truncated or corrupt GGUF and safetensors files, unsupported or unknown GGML tensor types, tensors
of the wrong shape. Engine options: unknown keywords, float16 on CPU, CUDA without CUDA. Requests:
empty prompts, bad token ids, out-of-range sampling parameters, wrong argument types. After every
request error the same LLM still generates exactly what it generated before, with no KV block or
request left behind.
"""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams, TokenmillError
from tokenmill.errors import CheckpointError, UnsupportedModelError
from tokenmill.sampling.params import SamplingParamsError

PROMPT = "Once upon a time"


def greedy(max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def raises(cls: type[TokenmillError], fn, *names: str) -> TokenmillError:
    """Call fn; it must raise `cls` (a TokenmillError) with every one of `names` in the message."""
    with pytest.raises(cls) as info:
        fn()
    assert isinstance(info.value, TokenmillError)
    message = str(info.value)
    assert "\n" not in message, message
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"
    return info.value


@pytest.fixture(scope="module")
def llama_dir(tiny_hf_model) -> Path:
    return tiny_hf_model("llama")


@pytest.fixture(scope="module")
def llama_gguf(tiny_gguf_model) -> Path:
    return tiny_gguf_model("llama", "F32")


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), dtype="float32")


@pytest.fixture(scope="module")
def reference(llm) -> list[int]:
    return llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids


def assert_still_works(llm: LLM, reference: list[int]) -> None:
    assert llm.engine.num_free_blocks == llm.engine.pool.num_blocks, "KV blocks leaked"
    assert not llm.engine.has_unfinished() and not llm._processor.has_unfinished()
    assert llm.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids == reference
    assert [o.outputs[0].token_ids for o in llm.generate([PROMPT, "The cat"], greedy(), use_tqdm=False)][0] \
        == reference


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- model paths and folders


def test_missing_path(tmp_path):
    raises(CheckpointError, lambda: LLM(str(tmp_path / "nowhere")), str(tmp_path / "nowhere"), "does not exist")
    raises(CheckpointError, lambda: LLM(str(tmp_path / "nowhere.gguf")), "nowhere.gguf")


def test_empty_folder(tmp_path):
    raises(CheckpointError, lambda: LLM(str(tmp_path)), str(tmp_path), "config.json")


def test_folder_without_safetensors(llama_dir, tmp_path):
    shutil.copy(llama_dir / "config.json", tmp_path)
    raises(CheckpointError, lambda: LLM(str(tmp_path)), str(tmp_path), "safetensors")


def test_folder_with_only_a_pickle_checkpoint(llama_dir, tmp_path):
    folder = copy_folder(llama_dir, tmp_path / "pickled")
    (folder / "model.safetensors").unlink()
    torch.save({"lm_head.weight": torch.zeros(2, 2)}, folder / "pytorch_model.bin")
    raises(CheckpointError, lambda: LLM(str(folder)), "pytorch_model.bin", "pickle", "safetensors")


def test_unsupported_architecture(llama_dir, tmp_path):
    folder = copy_folder(llama_dir, tmp_path / "falcon")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    raises(UnsupportedModelError, lambda: LLM(str(folder)), "FalconForCausalLM", "LlamaForCausalLM")


def test_config_that_is_not_json(llama_dir, tmp_path):
    folder = copy_folder(llama_dir, tmp_path / "badjson")
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],', encoding="utf-8")
    raises(CheckpointError, lambda: LLM(str(folder)), str(folder / "config.json"), "JSON")


def test_config_missing_a_required_key(llama_dir, tmp_path):
    folder = copy_folder(llama_dir, tmp_path / "nohidden")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    raises(CheckpointError, lambda: LLM(str(folder)), "hidden_size")


def test_config_value_of_the_wrong_type(llama_dir, tmp_path):
    folder = copy_folder(llama_dir, tmp_path / "badeps")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config["rms_norm_eps"] = "tiny"
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    raises(CheckpointError, lambda: LLM(str(folder)), "rms_norm_eps")


def test_gguf_missing_a_required_key(llama_gguf, tmp_path):
    path = tmp_path / "noblocks.gguf"
    shutil.copy(llama_gguf, path)
    reader = gguf.GGUFReader(path, "r+")
    key = reader.fields["llama.block_count"].parts[1]  # the key's bytes: rename it, same length
    key[:] = np.frombuffer(b"llama.block_couxx", dtype=np.uint8)
    reader.data.flush()
    del reader
    raises(CheckpointError, lambda: LLM(str(path)), str(path), "block_count")


# ---------------------------------------------------------------- corrupt files


@pytest.mark.parametrize(("cut", "reason"), [
    ("half", "truncated"), ("last-byte", "truncated"), ("tensor-infos", "truncated"), ("metadata", "truncated"),
    ("magic", "GGUF magic"), ("empty", "empty"),
])
def test_truncated_gguf(llama_gguf, tmp_path, cut, reason):
    data = llama_gguf.read_bytes()
    first_tensor = min(t.data_offset for t in gguf.GGUFReader(llama_gguf).tensors)
    size = {"half": len(data) // 2, "last-byte": len(data) - 1, "tensor-infos": first_tensor - 100,
            "metadata": 200, "magic": 3, "empty": 0}[cut]
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:size])
    raises(CheckpointError, lambda: LLM(str(path)), str(path), reason)


@pytest.mark.parametrize("damage", ["garbage", "half", "header"])
def test_corrupt_safetensors(llama_dir, tmp_path, damage):
    folder = copy_folder(llama_dir, tmp_path / "damaged")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"garbage": bytes(range(256)) * 8, "half": data[: len(data) // 2],
                         "header": data[:6]}[damage])
    raises(CheckpointError, lambda: LLM(str(folder)), str(weights))


def _patch_gguf_tensor(src: Path, dst: Path, name: str, *, ggml_type: int | None = None,
                       dims: list[int] | None = None) -> Path:
    """Copy a GGUF file, rewriting one tensor's type id or dimensions in its header."""
    shutil.copy(src, dst)
    reader = gguf.GGUFReader(dst, "r+")
    (tensor,) = [t for t in reader.tensors if t.name == name]
    # tensor info parts: name length, name, n_dims, dims, type, data offset
    if ggml_type is not None:
        tensor.field.parts[4][0] = ggml_type
    if dims is not None:
        tensor.field.parts[3][:] = dims
    reader.data.flush()
    del reader
    return dst


def test_gguf_tensor_of_an_unsupported_type(llama_gguf, tmp_path):
    path = _patch_gguf_tensor(llama_gguf, tmp_path / "mxfp4.gguf", "blk.0.ffn_down.weight",
                              ggml_type=gguf.GGMLQuantizationType.MXFP4.value)
    raises(UnsupportedModelError, lambda: LLM(str(path)), str(path), "blk.0.ffn_down.weight", "MXFP4")


def test_gguf_tensor_of_an_unknown_type(llama_gguf, tmp_path):
    path = _patch_gguf_tensor(llama_gguf, tmp_path / "unknown.gguf", "blk.0.ffn_down.weight", ggml_type=1000)
    raises(CheckpointError, lambda: LLM(str(path)), str(path), "corrupt")


def test_gguf_tensor_of_the_wrong_shape(llama_gguf, tmp_path):
    # ffn_down is [128, 64] in GGUF order (64 x 128 in torch order); swap to the same byte size.
    path = _patch_gguf_tensor(llama_gguf, tmp_path / "shape.gguf", "blk.0.ffn_down.weight", dims=[64, 128])
    raises(CheckpointError, lambda: LLM(str(path)), str(path), "down", "(128, 64)", "(64, 128)")


def _rewrite_weights(folder: Path, edit) -> None:
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def test_safetensors_tensor_of_the_wrong_shape(llama_dir, tmp_path):
    folder = copy_folder(llama_dir, tmp_path / "shape")
    name = "model.layers.1.mlp.down_proj.weight"

    def edit(tensors):
        tensors[name] = tensors[name][:, :96].contiguous()

    _rewrite_weights(folder, edit)
    raises(CheckpointError, lambda: LLM(str(folder)), name, "(64, 96)", "(64, 128)")


def test_safetensors_missing_or_extra_tensor(llama_dir, tmp_path):
    missing = copy_folder(llama_dir, tmp_path / "missing")
    _rewrite_weights(missing, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    # k_proj is one shard of the fused qkv weight: the message names the fused parameter.
    raises(CheckpointError, lambda: LLM(str(missing)), str(missing), "layers.0.self_attn.qkv_proj.weight")
    extra = copy_folder(llama_dir, tmp_path / "extra")
    _rewrite_weights(extra, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(3)}))
    raises(CheckpointError, lambda: LLM(str(extra)), "model.layers.0.mystery.weight")


def test_config_disagreeing_with_the_tensors(llama_dir, tmp_path):
    folder = copy_folder(llama_dir, tmp_path / "wide")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config["intermediate_size"] = 100
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    raises(CheckpointError, lambda: LLM(str(folder)), "mlp", "128", "100")


# ---------------------------------------------------------------- engine options


def test_unknown_engine_option(llama_dir):
    raises(TokenmillError, lambda: LLM(str(llama_dir), unknown_kwarg=1), "unknown_kwarg")


def test_float16_on_cpu(llama_dir):
    raises(TokenmillError, lambda: LLM(str(llama_dir), dtype="float16", device="cpu"), "float16", "CPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda(llama_dir):
    raises(TokenmillError, lambda: LLM(str(llama_dir), device="cuda"), "device", "cuda", "CUDA is not available")


@pytest.mark.parametrize(("option", "value"), [
    ("dtype", "int8"), ("device", "tpu"), ("max_model_len", 100_000), ("block_size", 0), ("max_num_seqs", -1),
    ("num_kv_blocks", 0),
])
def test_out_of_range_engine_options(llama_dir, option, value):
    raises(TokenmillError, lambda: LLM(str(llama_dir), **{option: value}), option)


# ---------------------------------------------------------------- requests on a working LLM


@pytest.mark.parametrize("prompts", [
    pytest.param("", id="empty-string"),
    pytest.param([PROMPT, ""], id="empty-string-in-a-batch"),
    pytest.param([[]], id="empty-token-list"),
])
def test_empty_prompt(llm, reference, prompts):
    raises(TokenmillError, lambda: llm.generate(prompts, greedy(), use_tqdm=False), "prompt")
    raises(TokenmillError, lambda: list(llm.stream("", greedy())), "prompt")
    assert_still_works(llm, reference)


@pytest.mark.parametrize("prompts", [
    pytest.param([5, 400], id="id-past-the-vocabulary"),
    pytest.param([-1, 5], id="negative-id"),
    pytest.param([[5, 6], [7, 10**9]], id="second-prompt-bad"),
    pytest.param([1, 2**64], id="id-past-int64"),
    pytest.param([1, -(2**63) - 1], id="negative-past-int64"),
    pytest.param([1.5, 2.0], id="floats"),
    pytest.param([None], id="none"),
    pytest.param(5, id="an-int"),
    pytest.param({"text": "hi"}, id="a-dict-of-another-key"),   # ({"prompt": ...} is vLLM's TextPrompt)
    pytest.param({"prompt_token_ids": [5, 400]}, id="a-tokens-dict-past-the-vocabulary"),
])
def test_bad_prompt_values(llm, reference, prompts):
    raises(TokenmillError, lambda: llm.generate(prompts, greedy(), use_tqdm=False), "prompt")
    assert_still_works(llm, reference)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 2.0), ("n", 0), ("max_tokens", 0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("logprobs", 21), ("seed", 2**64), ("stop", [""]), ("stop_token_ids", [-1]),
    ("logit_bias", {1: 1000.0}), ("ignore_eos", "yes"),
    # values that pass a plain range check but that the float32 sampler cannot honour, and sizes
    # that would be allocated before any other check
    ("top_p", 1e-46), ("top_p", 1e-300), ("temperature", 1e308), ("temperature", 10**400),
    ("repetition_penalty", 1e308), ("repetition_penalty", 1e-300), ("n", 10**30), ("n", 10**8), ("n", 129),
    ("logit_bias", {"9" * 5000: 1.0}), ("logit_bias", {i: 1.0 for i in range(1025)}), ("stop", ["x"] * 65),
    ("stop_token_ids", list(range(1025))),
])
def test_out_of_range_sampling_params(field, value):
    error = raises(SamplingParamsError, lambda: SamplingParams(**{field: value}), field)
    assert error.field == field or error.field.startswith(f"{field}[")


def test_seed_of_the_last_sample_must_be_valid():
    raises(SamplingParamsError, lambda: SamplingParams(n=2, seed=2**64 - 1), "seed", "seed + i")
    assert SamplingParams(n=2, seed=2**64 - 2).seed == 2**64 - 2


def test_tiny_top_p_keeps_the_most_likely_token(llm, reference):
    """The smallest top_p accepted keeps exactly the argmax (the old failure: top_p 1e-46 became
    0.0 in float32 and indexed position -1, failing every request of the step)."""
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=2.0**-126, ignore_eos=True, seed=1)
    assert llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == reference


def test_min_tokens_above_max_tokens():
    error = raises(SamplingParamsError, lambda: SamplingParams(min_tokens=5, max_tokens=2), "min_tokens", "2")
    assert error.field == "min_tokens"


@pytest.mark.parametrize(("field", "params"), [
    ("logit_bias", SamplingParams(logit_bias={400: 1.0})),
    ("stop_token_ids", SamplingParams(stop_token_ids=[2, 10**6])),
    ("max_tokens", SamplingParams(max_tokens=1000)),
])
def test_sampling_params_checked_against_the_model(llm, reference, field, params):
    """Valid alone, refused for this model (vocabulary 400, context 256); a batch is all or nothing."""
    raises(TokenmillError, lambda: llm.generate(PROMPT, params, use_tqdm=False), field)
    raises(TokenmillError, lambda: llm.generate([PROMPT, PROMPT], [greedy(), params], use_tqdm=False), field)
    raises(TokenmillError, lambda: next(llm.stream(PROMPT, params)), field)
    assert_still_works(llm, reference)


def test_min_tokens_beyond_the_room_left_in_the_context(llm, reference):
    """Context 256: with max_tokens None a request may generate 256 - prompt tokens, so a larger
    min_tokens can never be honoured."""
    raises(SamplingParamsError, lambda: llm.generate(PROMPT, SamplingParams(max_tokens=None, min_tokens=300),
                                                     use_tqdm=False), "min_tokens", "max_model_len")
    assert_still_works(llm, reference)


def test_prompt_longer_than_the_context(llm, reference):
    raises(TokenmillError, lambda: llm.generate([[5] * 300], greedy(), use_tqdm=False), "prompt", "max_model_len")
    assert_still_works(llm, reference)


@pytest.mark.parametrize("params", [
    pytest.param({"temperature": 0}, id="a-dict"),
    pytest.param([greedy()], id="too-few"),
    pytest.param([greedy(), greedy(), greedy()], id="too-many"),
    pytest.param(["greedy", "greedy"], id="strings"),
])
def test_bad_sampling_params_argument(llm, reference, params):
    raises(TokenmillError, lambda: llm.generate([PROMPT, PROMPT], params, use_tqdm=False), "sampling_params")
    raises(TokenmillError, lambda: next(llm.stream(PROMPT, {"temperature": 0})), "sampling_params")
    assert_still_works(llm, reference)


@pytest.mark.parametrize(("messages", "names"), [
    pytest.param([{"role": "user", "content": 5}], ["messages[0].content"], id="content-an-int"),
    pytest.param([{"role": "user"}], ["messages[0].content"], id="no-content"),
    pytest.param([{"role": "robot", "content": "hi"}], ["messages[0].role", "robot"], id="unknown-role"),
    pytest.param([{"role": "user", "content": "hi"}, "x"], ["messages[1]"], id="not-a-dict"),
    pytest.param([{"role": "user", "content": "a\ud800b"}], ["surrogate"], id="lone-surrogate"),
])
def test_chat_messages_are_checked_like_the_server_does(llm, reference, messages, names):
    raises(TokenmillError, lambda: llm.chat(messages, greedy(), use_tqdm=False), *names)
    assert_still_works(llm, reference)


def test_chat_developer_role_and_text_parts_are_the_servers_forms(llm):
    """OpenAI's `developer` role is the template's `system`, and text parts are joined: the
    Python API takes what the server takes."""
    plain = llm.chat_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], True)
    assert llm.chat_prompt([{"role": "developer", "content": [{"type": "text", "text": "Be "},
                                                               {"type": "text", "text": "brief."}]},
                            {"role": "user", "content": "hi"}], True) == plain


@pytest.mark.parametrize("template", [
    pytest.param("{% for i in range(10**9) %}x{% endfor %}", id="huge-range"),
    pytest.param("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", id="recursive-macro"),
    pytest.param("{{ (10**100000)|string }}", id="huge-int-to-string"),
    pytest.param("{{ 10 ** 1000000000 }}", id="huge-power"),
    pytest.param("{{ 'x' * 10**10 }}", id="huge-repeat"),
])
def test_chat_template_that_raises_anything_is_a_clear_error(llama_dir, tmp_path, template):
    folder = copy_folder(llama_dir, tmp_path / "template")
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    llm = LLM(str(folder), dtype="float32")
    raises(TokenmillError, lambda: llm.chat([{"role": "user", "content": "hi"}], greedy(), use_tqdm=False),
           str(folder), "chat template")
    assert llm.engine.num_free_blocks == llm.engine.pool.num_blocks


def test_one_llm_runs_one_call_at_a_time(llm, reference):
    """An open stream holds the LLM: a generate from another thread, or a second stream, is refused
    with a clear error instead of stepping the first one's requests; once the stream is closed the
    LLM works again. Three threads calling generate at once either get the reference or that error."""
    stream = llm.stream(PROMPT, greedy())
    first = next(stream)
    assert not first.finished
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(lambda: llm.generate(PROMPT, greedy(), use_tqdm=False)).exception()
    assert isinstance(refused, TokenmillError) and "another generate / chat / stream call" in str(refused)
    raises(TokenmillError, lambda: next(llm.stream(PROMPT, greedy())), "another generate")
    assert list(stream)[-1].outputs[0].token_ids == reference      # the first stream was not disturbed
    barrier = threading.Barrier(3)

    def call() -> list[int] | str:
        barrier.wait()
        try:
            return llm.generate(PROMPT, greedy(32), use_tqdm=False)[0].outputs[0].token_ids[:8]
        except TokenmillError as e:
            return str(e)

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: call(), range(3)))
    assert reference in results
    assert all(r == reference or "another generate" in r for r in results), results
    assert_still_works(llm, reference)


def test_gguf_quantized_row_not_a_whole_number_of_blocks(tiny_gguf_model, tmp_path):
    """A Q4_1 tensor whose row (575) is not a multiple of its 32-value blocks: GGUFReader refuses
    such a file, and so do we, with the tensor's name (it was a numpy reshape traceback)."""
    path = _patch_gguf_tensor(tiny_gguf_model("llama", "Q4_1"), tmp_path / "rows.gguf", "blk.0.ffn_down.weight",
                              dims=[127, 64])
    raises(CheckpointError, lambda: LLM(str(path)), str(path), "blk.0.ffn_down.weight", "127", "block size 32")


def test_bad_chat_input(llm, reference, llama_dir, tmp_path):
    raises(TokenmillError, lambda: llm.chat([{"role": "user"}], greedy(), use_tqdm=False), "messages[0].content")
    raises(TokenmillError, lambda: llm.stream(messages=[{"role": "user"}]).__next__(), "messages[0].content")
    raises(TokenmillError, lambda: list(llm.stream(PROMPT, messages=[{"role": "user", "content": "x"}])),
           "prompt", "messages")
    for messages in (None, "hello", [None], [[{"role": "user", "content": "x"}], "abc"]):
        raises(TokenmillError, lambda m=messages: llm.chat(m, greedy(), use_tqdm=False), "messages")
    assert_still_works(llm, reference)
    folder = copy_folder(llama_dir, tmp_path / "notemplate")
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    no_template = LLM(str(folder), dtype="float32")
    raises(TokenmillError, lambda: no_template.chat([{"role": "user", "content": "hi"}], use_tqdm=False),
           str(folder), "chat template")
    assert no_template.generate(PROMPT, greedy(), use_tqdm=False)[0].outputs[0].token_ids == reference
