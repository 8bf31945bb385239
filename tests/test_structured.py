"""Structured output (constrained decoding) on the default model, through the Python API.

The claims: every constrained output is valid (20 realistic JSON schemas x 10 samples at
temperature 1.0 validate with `jsonschema`; regex and choice outputs match), a constraint changes
nothing about how a request runs with others (mixed batches, chunked prefill, preemption, prefix
caching, n > 1, stop strings, max_tokens running out), log-probabilities are of the distribution
the token was drawn from, and jump-forward (appending a token the grammar forces without a model
step) changes no token.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.schemas import SCHEMAS
from tokenmill.engine import grammar as grammar_module
from tokenmill.errors import SamplingParamsError, TokenmillError
from tokenmill.sampling import Sampler, SamplingBatch
from tokenmill.sampling.structured import StructuredOutputsParams

PROMPT = "Answer with a JSON object."


@pytest.fixture(scope="module")
def llm(default_gguf_path) -> LLM:
    return LLM(str(default_gguf_path))


def chat(llm: LLM, params: SamplingParams | list[SamplingParams], n_prompts: int = 1, content: str = PROMPT):
    return llm.chat([[{"role": "user", "content": content}]] * n_prompts, params, use_tqdm=False)


def json_params(schema: dict, **kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kwargs)


# ---- the sampler's mask --------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab_size", [64, 1000, 49152])
def test_grammar_masks_ban_exactly_the_disallowed_tokens(vocab_size):
    """Bit t % 32 of word t // 32 allows token t: the sampler never picks another (greedy takes the
    best allowed one), a row without a mask is untouched, and a vocabulary that is not a multiple
    of 32 (the last word's spare bits) works."""
    rng = np.random.default_rng(0)
    words = -(-vocab_size // 32)
    allowed = rng.random((3, words * 32)) < 0.01
    allowed[:, 5] = True
    masks = [np.packbits(row, bitorder="little").view(np.int32) for row in allowed]
    logits = torch.randn(4, vocab_size)
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate((0.0, 1.0, 1.0, 0.0))]
    batch = SamplingBatch.build(params, [[1]] * 4, [[]] * 4, [None] * 4, vocab_size, frozenset(), "cpu",
                                grammar_masks=[*masks, None])
    assert torch.equal(batch.banned[:3], torch.from_numpy(~allowed[:, :vocab_size]))
    assert not batch.banned[3].any()
    for _ in range(20):
        out = Sampler()(logits, batch).token_ids.tolist()
        assert all(allowed[row, out[row]] for row in range(3))
    best_allowed = logits[0].masked_fill(batch.banned[0], float("-inf")).argmax().item()
    assert out[0] == best_allowed and out[3] == logits[3].argmax().item()


# ---- every output valid -------------------------------------------------------------------------------

@pytest.mark.slow
def test_twenty_schemas_ten_samples_each_at_temperature_one_all_validate(llm):
    """200 constrained samples at temperature 1.0, all submitted at once (batched together): each
    parses and validates. Three samples per schema of the same requests unconstrained are counted
    for contrast."""
    # (no keyword bounds log_entry's free-form map, nor comment_thread's recursion)
    cases = [case._replace(schema=bounded(case.schema)) for case in SCHEMAS
             if case.name not in ("log_entry", "comment_thread")]
    assert len(cases) == 20
    prompts = [f"{PROMPT} It describes: {case.name}. Fields: {', '.join(case.schema.get('properties', {}))}."
               for case in cases]
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    constrained = llm.chat(conversations, [json_params(c.schema, n=10, temperature=1.0, seed=i, max_tokens=1200)
                                           for i, c in enumerate(cases)], use_tqdm=False)
    free = llm.chat(conversations, SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=120), use_tqdm=False)
    failures = []
    for case, out in zip(cases, constrained, strict=True):
        for sample in out.outputs:
            try:
                assert sample.finish_reason == "stop", sample.finish_reason
                jsonschema.validate(json.loads(sample.text), case.schema,
                                    format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            except Exception as e:
                failures.append((case.name, sample.text[:200], repr(e)[:300]))
    assert not failures, failures
    free_valid = sum(_validates(s.text, c.schema) for c, out in zip(cases, free, strict=True) for s in out.outputs)
    print(f"\nconstrained: 200/200 valid; unconstrained: {free_valid}/60 valid")
    assert free_valid < 60   # (the contrast: without the constraint this model rarely writes valid JSON)


def bounded(schema: object) -> object:
    """`schema` with tighter bounds: strings at most 40 characters (also with a format or pattern),
    arrays at most 3 items, numbers within +-10**6 (each unless the schema needs more), objects
    without undeclared properties (unless the schema declares what they may be). A 135M model sampled at temperature 1.0
    inside an unbounded lexeme (an email's local part, an integer's digits) may otherwise never
    leave it, and an output cut by max_tokens is not one the constraint got wrong."""
    if isinstance(schema, list):
        return [bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded(value) for key, value in schema.items()}
    kind = schema.get("type")   # (not a type in a "properties" map that has a property named "type")
    types = {t for t in (kind if isinstance(kind, list) else [kind]) if isinstance(t, str)}
    if "string" in types and not {"enum", "const"} & set(schema):
        out["maxLength"] = max(min(schema.get("maxLength", 40), 40), schema.get("minLength", 0))
    if "array" in types:
        out["maxItems"] = max(min(schema.get("maxItems", 3), 3), schema.get("minItems", 0))
    if "object" in types:
        out.setdefault("additionalProperties", False)
    if {"integer", "number"} & types and not {"enum", "const"} & set(schema):
        out.setdefault("minimum", -(10**6))
        out.setdefault("maximum", 10**6)
    return out


def _validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_regex_and_choice_outputs_match(llm):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["red", "green", "dark blue"]
    forms = [{"regex": phone}, {"choice": choices}]
    outs = llm.generate(["My phone number is", "My favourite colour is"] * 4, [
        SamplingParams(structured_outputs=forms[i % 2], temperature=1.0, seed=i, max_tokens=30) for i in range(8)],
        use_tqdm=False)
    for i, out in enumerate(outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(phone, text) if i % 2 == 0 else text in choices, text


def test_grammar_in_lark_and_in_gbnf(llm):
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    gbnf = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no"'
    for grammar in (lark, gbnf):
        out = llm.generate("Q: is water wet?", SamplingParams(structured_outputs={"grammar": grammar}, max_tokens=20,
                                                               temperature=0), use_tqdm=False)
        assert re.fullmatch(r"The answer is (yes|no)\.", out[0].outputs[0].text), out[0].outputs[0].text


def test_json_object_output_is_one_object(llm):
    out = chat(llm, SamplingParams(structured_outputs={"json_object": True}, temperature=0, max_tokens=200))
    assert out[0].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(out[0].outputs[0].text), dict)


def test_compact_json_has_no_whitespace(llm):
    schema = SCHEMAS[0].schema
    out = chat(llm, SamplingParams(structured_outputs={"json": schema, "disable_any_whitespace": True},
                                   temperature=0, max_tokens=300))
    text = out[0].outputs[0].text
    assert json.loads(text) is not None
    assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text


# ---- the engine's features ----------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def _mixed_requests() -> tuple[list[str], list[SamplingParams]]:
    prompts = [f"<|im_start|>system\nYou write records of people for a database, one JSON object each.<|im_end|>\n"
               f"<|im_start|>user\nPerson number {i}, as JSON<|im_end|>\n<|im_start|>assistant\n" for i in range(6)]
    params = [json_params(SCHEMA, temperature=0, max_tokens=80) if i % 2 == 0 else
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True) for i in range(6)]
    return prompts, params


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_mixed_batch_equals_each_request_alone(llm):
    prompts, params = _mixed_requests()
    together = _tokens(llm.generate(prompts, params, use_tqdm=False))
    alone = [_tokens(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(prompts, params, strict=True)]
    assert together == alone


@pytest.mark.parametrize("engine_args", [
    {"num_kv_blocks": 12, "block_size": 16, "max_model_len": 192},   # a preemption storm
    {"max_num_batched_tokens": 16},                                   # chunked prefill
    {"enable_prefix_caching": False},
], ids=["preemption", "chunked-prefill", "no-prefix-cache"])
def test_constrained_requests_under_preemption_chunking_and_without_prefix_cache(llm, default_gguf_path,
                                                                                 engine_args):
    prompts, params = _mixed_requests()
    expected = _tokens(llm.generate(prompts, params, use_tqdm=False))
    other = LLM(str(default_gguf_path), **engine_args)
    got = _tokens(other.generate(prompts, params, use_tqdm=False))
    if "num_kv_blocks" in engine_args:
        assert other.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_prefix_cache_hit_gives_the_same_constrained_output(llm):
    prompts, params = _mixed_requests()
    first = _tokens(llm.generate(prompts[:1], params[:1], use_tqdm=False))
    again = llm.generate(prompts[:1], params[:1], use_tqdm=False)
    assert again[0].num_cached_tokens > 0 and _tokens(again) == first


def test_n_samples_each_valid_and_seeded_reproducible(llm):
    params = json_params(SCHEMA, n=4, temperature=1.0, seed=7, max_tokens=120)
    first, second = chat(llm, params), chat(llm, params)
    assert [o.token_ids for o in first[0].outputs] == [o.token_ids for o in second[0].outputs]
    for sample in first[0].outputs:
        jsonschema.validate(json.loads(sample.text), SCHEMA)
    assert len({o.text for o in first[0].outputs}) > 1


def test_max_tokens_running_out_mid_object_ends_with_length(llm):
    out = chat(llm, json_params(SCHEMA, temperature=0, max_tokens=5))
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(out[0].outputs[0].text)


def test_stop_string_ends_a_constrained_request(llm):
    out = chat(llm, json_params(SCHEMA, temperature=0, max_tokens=80, stop=['"age"']))
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == '"age"'
    assert '"age"' not in out[0].outputs[0].text and '"name"' in out[0].outputs[0].text


def test_logprobs_are_of_the_masked_distribution(llm):
    """A choice between two words allows few tokens at the first step: their probabilities, as
    reported, sum to 1, and every reported alternative is one the grammar allows."""
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]}, temperature=1.0, seed=3, logprobs=20,
                            max_tokens=5)
    out = chat(llm, params, content="Is the sky blue?")[0].outputs[0]
    first = out.logprobs[0]
    allowed = {tid for tid, lp in first.items() if lp.logprob > -math.inf}
    assert all(llm.tokenizer.decode([tid]) in ("y", "ye", "yes", "n", "no") for tid in allowed), \
        [llm.tokenizer.decode([t]) for t in allowed]
    assert math.isclose(sum(math.exp(lp.logprob) for lp in first.values() if lp.rank is not None), 1.0, rel_tol=1e-4)


# ---- jump-forward -------------------------------------------------------------------------------------

def test_a_finished_output_ends_without_another_model_step(llm):
    """After "yes" the grammar allows only EOS: the request ends in the step that sampled the
    last token of "yes", without sampling an EOS token."""
    out = llm.generate("Is the sky blue? Answer:", SamplingParams(structured_outputs={"choice": [" yes", " no"]},
                                                                   temperature=0, max_tokens=10), use_tqdm=False)
    tokens = out[0].outputs[0].token_ids
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].text in (" yes", " no")
    assert llm.tokenizer.decode(tokens) == out[0].outputs[0].text   # (no EOS token among them)


def test_jump_forward_changes_no_token(llm, monkeypatch):
    """Greedy outputs over many schemas with jump-forward, and with every forced token sampled by
    a model step instead: the same tokens (without jump-forward the model also samples the final
    EOS, which with it is never appended)."""
    prompts = [f"{PROMPT} ({case.name})" for case in SCHEMAS[:8]]
    params = [json_params(case.schema, temperature=0, max_tokens=300) for case in SCHEMAS[:8]]
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    jumped = llm.chat(conversations, params, use_tqdm=False)
    forced_before = llm.engine.num_forced_tokens
    monkeypatch.setattr(grammar_module.GrammarMatcher, "forced_token", lambda self: None)
    stepped = llm.chat(conversations, params, use_tqdm=False)
    assert llm.engine.num_forced_tokens == forced_before
    assert llm.engine.num_forced_tokens > 0 and any(out.outputs[0].finish_reason == "stop" for out in jumped)
    for a, b in zip(jumped, stepped, strict=True):
        a_ids, b_ids = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        if b.outputs[0].finish_reason == "stop":
            assert b_ids[-1] in llm.engine.eos_token_ids and a_ids == b_ids[:-1]
        else:   # max_tokens ran out in both
            assert a_ids == b_ids
        assert a.outputs[0].text == b.outputs[0].text


# ---- refused ------------------------------------------------------------------------------------------

def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


DEEP = _nested(5000)        # deeper than Python's recursion limit: json can neither write nor read it
CYCLIC: dict = {"type": "array"}
CYCLIC["items"] = CYCLIC


@pytest.mark.parametrize("spec,field,words", [
    ({"json": {"type": "wat"}}, "structured_outputs.json", ["wat"]),
    ({"json": "{not json"}, "structured_outputs.json", ["not valid JSON"]),
    ({"regex": "(("}, "structured_outputs.regex", ["unclosed group"]),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar", ["undefined_rule"]),
    ({"choice": []}, "structured_outputs.choice", ["non-empty"]),
    ({"json": {}, "regex": "a"}, "structured_outputs", ["exactly one"]),
    ({}, "structured_outputs", ["exactly one"]),
    ({"jsn": {}}, "structured_outputs.jsn", ["not a structured output field"]),
    ({"json": DEEP}, "structured_outputs.json", ["nested too deeply"]),
    ({"json": '{"items": ' * 5000 + "{}" + "}" * 5000}, "structured_outputs.json", ["nested too deeply"]),
    ({"json": CYCLIC}, "structured_outputs.json", ["not JSON data", "Circular"]),
    ({"json": {"enum": {1, 2}}}, "structured_outputs.json", ["not JSON data", "set"]),
])
def test_invalid_constraints_are_refused_naming_the_field(llm, spec, field, words):
    with pytest.raises(SamplingParamsError) as e:
        llm.generate("x", SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert e.value.field == field
    for word in words:
        assert word in str(e.value)


def test_min_tokens_cannot_be_combined_with_a_constraint():
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=3, structured_outputs={"regex": "a+"})


def test_a_refused_constraint_leaves_the_engine_serving(llm):
    with pytest.raises(TokenmillError):
        llm.generate("x", SamplingParams(structured_outputs={"regex": "(("}), use_tqdm=False)
    out = llm.generate("x", SamplingParams(structured_outputs={"regex": "[ab]{3}"}, max_tokens=5), use_tqdm=False)
    assert re.fullmatch("[ab]{3}", out[0].outputs[0].text)


def test_a_constraint_past_the_parser_limits_fails_alone(llm):
    """a{1000000} compiles, but its lexer outgrows llguidance's limits at the first token: that
    request ends with "error", the one batched with it is untouched."""
    neighbour = SamplingParams(max_tokens=5, temperature=0)
    alone = llm.generate(["y"], neighbour, use_tqdm=False)[0].outputs[0].token_ids
    hostile, other = llm.generate(["x", "y"], [SamplingParams(structured_outputs={"regex": "a{1000000}"},
                                                              max_tokens=5), neighbour], use_tqdm=False)
    assert hostile.outputs[0].finish_reason == "error" and "lexer" in hostile.error
    assert hostile.error_param == "structured_outputs.regex"
    assert hostile.error.startswith("structured_outputs.regex failed during generation")
    assert other.outputs[0].token_ids == alone
