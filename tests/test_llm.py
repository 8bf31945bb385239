"""The offline Python API (`tokenmill.LLM`, vLLM's names) on tiny random models and the default model.

Tiny models: prompt forms and output order, text == decode(token_ids), finish reasons, stop
strings and stop tokens, n > 1, seeded sampling, logprobs against `transformers`' logits, chat
templates (and BOS handling), streaming, generation_config defaults.

Default model (SmolLM2-135M-Instruct, Q4_1 GGUF): greedy tokens identical to `transformers`
loading the same GGUF file, and a chat reply that ends on EOS.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams, TokenmillError
from tokenmill.engine import runner as runner_module

PROMPTS = ["Once upon a time", "The cat sat on the", "To make bread, mix", "A user asks a question"]
EOS = 2  # the tiny tokenizer's <|im_end|>
BOS = 1  # the tiny tokenizer's <|im_start|>


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def run(llm: LLM, prompts, params=None):
    return llm.generate(prompts, params, use_tqdm=False)


def assert_engine_idle(llm: LLM) -> None:
    assert llm.engine.num_free_blocks == llm.engine.pool.num_blocks, "KV blocks leaked"
    assert not llm.engine.has_unfinished()
    assert not llm._processor.has_unfinished()


@pytest.fixture(scope="module")
def llama_dir(tiny_hf_model) -> Path:
    return tiny_hf_model("llama")


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), dtype="float32")


def _copy_folder(src: Path, dst: Path, tokenizer_config: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if tokenizer_config is not None:
        path = dst / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        config.update(tokenizer_config)
        path.write_text(json.dumps(config), encoding="utf-8")
    return dst


# ---------------------------------------------------------------- prompt forms and outputs


def test_generate_accepts_every_prompt_form_and_keeps_order(llm):
    tok = llm.tokenizer
    params = greedy(10)
    alone = [run(llm, p, params) for p in PROMPTS]  # a single string, one call each
    for prompt, outs in zip(PROMPTS, alone, strict=True):
        assert len(outs) == 1
        out = outs[0]
        assert out.prompt == prompt
        assert out.prompt_token_ids == tok.encode(prompt)
        assert [c.index for c in out.outputs] == [0]
        assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"
    expected = [outs[0].outputs[0].token_ids for outs in alone]
    assert len({tuple(t) for t in expected}) == len(PROMPTS), "prompts must give distinct outputs"

    for order in (PROMPTS, PROMPTS[::-1]):  # a list of strings, in order
        outs = run(llm, order, params)
        assert [o.prompt for o in outs] == order
        assert [o.outputs[0].token_ids for o in outs] == [expected[PROMPTS.index(p)] for p in order]
        assert len({o.request_id for o in outs}) == len(order)

    ids = [tok.encode(p) for p in PROMPTS]
    one = run(llm, ids[2], params)  # a list of token ids is ONE prompt
    assert len(one) == 1 and one[0].prompt is None and one[0].prompt_token_ids == ids[2]
    assert one[0].outputs[0].token_ids == expected[2]
    many = run(llm, ids[::-1], params)  # a list of lists of token ids
    assert [o.prompt_token_ids for o in many] == ids[::-1]
    assert [o.outputs[0].token_ids for o in many] == expected[::-1]
    # vLLM's dict prompts: TextPrompt and TokensPrompt, alone or in a list
    (text,) = run(llm, {"prompt": PROMPTS[1]}, params)
    assert text.prompt == PROMPTS[1] and text.outputs[0].token_ids == expected[1]
    dicts = run(llm, [{"prompt_token_ids": ids[0]}, {"prompt": PROMPTS[2]}], params)
    assert dicts[0].prompt is None and dicts[0].prompt_token_ids == ids[0]
    assert [o.outputs[0].token_ids for o in dicts] == [expected[0], expected[2]]
    for bad, named in [({"prompt": PROMPTS[0], "prompt_token_ids": ids[0]}, "one key"),
                       ({"prompt": ids[0]}, "holds text"), ({"prompt_token_ids": PROMPTS[0]}, "holds text"),
                       ({"prompt_token_ids": {"prompt": PROMPTS[0]}}, "holds text"), ({}, "one key"),
                       ({"multi_modal_data": {}}, "multi_modal_data"), ({"prompt_token_ids": [-1]}, "token")]:
        with pytest.raises(TokenmillError, match=named):
            llm.generate(bad, params)


@pytest.mark.parametrize("seed", [0, 1])
def test_text_is_the_decoded_token_ids(llm, seed):
    """Sampled gibberish (byte tokens, partial UTF-8) streams into exactly decode(token_ids)."""
    tok = llm.tokenizer
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)
    outs = run(llm, PROMPTS, params)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == 40 and c.stop_reason is None
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_eos_finishes_with_stop_and_is_left_out_of_the_text(llm):
    tok = llm.tokenizer
    # Bias EOS to the top once min_tokens allows it: exactly 4 tokens, the last EOS.
    params = SamplingParams(max_tokens=20, min_tokens=3, temperature=0.0, logit_bias={EOS: 100.0})
    c = run(llm, PROMPTS[0], params)[0].outputs[0]
    assert len(c.token_ids) == 4 and c.token_ids[-1] == EOS and EOS not in c.token_ids[:3]
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True) == tok.decode(c.token_ids[:3])
    # As in vLLM, the EOS token is in token_ids but not in the text, unless include_stop_str_in_output.
    for include, suffix in ((False, ""), (True, "<|im_end|>")):
        special = run(llm, PROMPTS[0], SamplingParams(max_tokens=20, min_tokens=3, temperature=0.0,
                                                      logit_bias={EOS: 100.0}, skip_special_tokens=False,
                                                      include_stop_str_in_output=include))[0].outputs[0]
        assert special.token_ids == c.token_ids and special.text == c.text + suffix
    # ignore_eos: the same bias no longer ends the request.
    c = run(llm, PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, logit_bias={EOS: 100.0},
                                            ignore_eos=True))[0].outputs[0]
    assert c.token_ids == [EOS] * 6 and c.finish_reason == "length"


def test_stop_token_ids_end_generation(llm):
    tok = llm.tokenizer
    full = run(llm, PROMPTS[1], greedy(30))[0].outputs[0].token_ids
    j = next(i for i in range(4, 30) if full[i] not in full[:i])  # first occurrence, not at the start
    assert tok.decode([full[j]])  # a token with text, so leaving it out of the text shows
    c = run(llm, PROMPTS[1], greedy(30, stop_token_ids=[full[j]]))[0].outputs[0]
    assert c.token_ids == full[: j + 1]
    assert c.finish_reason == "stop" and c.stop_reason == full[j]
    # As in vLLM, the stop token is in token_ids but its text is not, unless include_stop_str_in_output.
    assert c.text == tok.decode(full[:j])
    kept = run(llm, PROMPTS[1], greedy(30, stop_token_ids=[full[j]], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.token_ids == c.token_ids and kept.text == tok.decode(full[: j + 1])


def test_per_prompt_sampling_params(llm):
    params = [greedy(3), SamplingParams(max_tokens=7, temperature=1.0, seed=3, ignore_eos=True), greedy(5)]
    outs = run(llm, PROMPTS[:3], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7, 5]
    for prompt, p, out in zip(PROMPTS[:3], params, outs, strict=True):
        assert out.outputs[0].token_ids == run(llm, prompt, p)[0].outputs[0].token_ids
    with pytest.raises(TokenmillError, match="sampling_params"):
        run(llm, PROMPTS[:3], params[:2])
    assert_engine_idle(llm)


# ---------------------------------------------------------------- stop strings


def _stop_across_tokens(llm: LLM) -> tuple[str, list[int], str, str, int]:
    """(prompt, greedy ids, greedy text, stop, start): a 4-character ASCII stop string that spans
    a token boundary and first occurs at `start` > 0 in the greedy continuation."""
    tok = llm.tokenizer
    for prompt in PROMPTS:
        c = run(llm, prompt, greedy(40))[0].outputs[0]
        text, ids = c.text, c.token_ids
        for j in range(2, len(ids) - 2):
            prefix = tok.decode(ids[:j], skip_special_tokens=True)
            k = len(prefix)
            stop = text[k - 2 : k + 2]
            if (text.startswith(prefix) and len(stop) == 4 and stop.isascii() and stop.isprintable()
                    and text.find(stop) == k - 2 and k > 2):
                return prompt, ids, text, stop, k - 2
    raise AssertionError("no greedy continuation holds a usable stop string")


def test_stop_string_truncates_the_text(llm):
    tok = llm.tokenizer
    prompt, full_ids, full_text, stop, start = _stop_across_tokens(llm)
    c = run(llm, prompt, greedy(40, stop=stop))[0].outputs[0]
    assert c.text == full_text[:start]
    assert stop not in c.text
    assert c.finish_reason == "stop" and c.stop_reason == stop
    # Generation ends at the token that completes the stop string.
    assert c.token_ids == full_ids[: len(c.token_ids)]
    assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])

    kept = run(llm, prompt, greedy(40, stop=stop, include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full_text[: start + len(stop)] and kept.finish_reason == "stop"
    assert kept.token_ids == c.token_ids

    # Of two stop strings, the one occurring first wins, whatever the list order.
    later = full_text[start + 3 : start + 6]
    assert len(later) == 3 and full_text.find(later) > start
    both = run(llm, prompt, greedy(40, stop=[later, stop]))[0].outputs[0]
    assert both.text == full_text[:start] and both.stop_reason == stop

    # A stop string that never occurs changes nothing.
    absent = "\x00never\x00"
    assert absent not in full_text
    c = run(llm, prompt, greedy(40, stop=absent))[0].outputs[0]
    assert c.text == full_text and c.token_ids == full_ids and c.finish_reason == "length"


# ---------------------------------------------------------------- n > 1 and seeds


def test_n_samples_have_indices_and_follow_seed_plus_i(llm):
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    out = run(llm, PROMPTS[0], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for i, c in enumerate(out.outputs):
        single = SamplingParams(max_tokens=10, temperature=1.0, seed=11 + i, ignore_eos=True)
        assert c.token_ids == run(llm, PROMPTS[0], single)[0].outputs[0].token_ids
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert_engine_idle(llm)


def test_seeded_sampling_reproduces_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    first = run(llm, PROMPTS[1], params)[0].outputs[0].token_ids
    assert run(llm, PROMPTS[1], params)[0].outputs[0].token_ids == first
    batch = run(llm, [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]], [
        SamplingParams(max_tokens=5, temperature=1.0, ignore_eos=True),               # unseeded
        params,
        SamplingParams(max_tokens=30, temperature=1.0, seed=99, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, seed=1235, ignore_eos=True),  # another seed
    ])
    assert batch[1].outputs[0].token_ids == first
    assert batch[3].outputs[0].token_ids != first
    assert first != run(llm, PROMPTS[1], greedy(16))[0].outputs[0].token_ids  # it really samples


# ---------------------------------------------------------------- logprobs


@pytest.mark.parametrize("k", [0, 5])
def test_logprobs_are_the_model_log_softmax(llm, llama_dir, k):
    tok = llm.tokenizer
    # temperature 0.7: logprobs must be of the raw distribution, not of the tempered one.
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=5, logprobs=k, ignore_eos=True)
    out = run(llm, PROMPTS[2], params)[0]
    c = out.outputs[0]
    ids = out.prompt_token_ids + c.token_ids
    ref_model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = ref_model(torch.tensor([ids])).logits[0]
    n = len(out.prompt_token_ids)
    ref = logits.log_softmax(-1)[n - 1 : len(ids) - 1]  # row j predicts output token j
    assert len(c.logprobs) == len(c.token_ids) == 8
    for j, (token_id, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        assert token_id in entry
        top = ref[j].topk(k).indices.tolist() if k else []
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None)
        assert [t for _, t in ranked] == top and [r for r, _ in ranked] == list(range(1, k + 1))
        assert set(entry) == set(top) | {token_id}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[j, t].item(), abs=1e-4)
            assert lp.decoded_token == tok.decode([t])
    expected_sum = sum(ref[j, t].item() for j, t in enumerate(c.token_ids))
    assert c.cumulative_logprob == pytest.approx(expected_sum, abs=1e-3)
    plain = run(llm, PROMPTS[2], SamplingParams(max_tokens=8, temperature=0.7, seed=5, ignore_eos=True))[0]
    assert plain.outputs[0].token_ids == c.token_ids  # asking for logprobs does not change sampling
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


LONG_PROMPT = "The river ran past the mill, and the miller counted the sacks of grain one by one " * 3


def assert_prompt_logprobs_match(out, ref: torch.Tensor, k: int, tok) -> None:
    """`out.prompt_logprobs` against `ref`, transformers' log_softmax over the prompt's rows."""
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry, row = out.prompt_logprobs[i], ref[i - 1]
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == set(top) | {ids[i]}
        assert [t for t, lp in entry.items() if lp.rank is not None and lp.rank <= k] == top
        assert entry[ids[i]].rank == int((row > row[ids[i]]).sum()) + 1
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=1e-4)
            assert lp.decoded_token == tok.decode([t])


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_are_the_model_log_softmax_whatever_the_chunks_and_cache(llama_dir, k, monkeypatch, caplog):
    """Prompt tokens scored as transformers scores them, with the prompt computed in one step or in
    chunks of 7 rows (scored 5 rows at a time), with the prefix cache holding it already (a request
    that wants its prompt scored computes it anyway), beside a request verifying n-gram proposals
    in the same steps, and with a draft model (its shadow scores nothing); n = 2 scores it once;
    sampling is unchanged."""
    monkeypatch.setattr(runner_module, "SCORE_ROWS", 5)
    scoring: list[str] = []   # the request of each scored row
    score = runner_module.score_prompts
    monkeypatch.setattr(runner_module, "score_prompts", lambda logits, index, scored: (
        scoring.extend(r.request_id for r, first, end in scored for _ in range(first, end)),
        score(logits, index, scored)))
    ref_model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
    repeating = "one two three four one two three four one two three four one two"
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    for options in ({}, {"max_num_batched_tokens": 7}, {"speculative_config": ngram, "max_num_batched_tokens": 16},
                    {"speculative_config": {"model": str(llama_dir), "num_speculative_tokens": 2}}):
        llm = LLM(str(llama_dir), dtype="float32", **options)
        first, beside = run(llm, [LONG_PROMPT, repeating], [params, greedy(24)])   # (the prompt's first sight)
        alone = run(llm, [LONG_PROMPT, repeating], greedy(24))
        assert beside.outputs[0].token_ids == alone[1].outputs[0].token_ids
        stats = llm.engine.stats()
        if "speculative_config" in options:
            assert stats.spec_num_draft_tokens > 0
        if "model" in options.get("speculative_config", {}):   # (the draft is the target: greedy, it is always right)
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        scoring.clear()
        again = run(llm, LONG_PROMPT, params)[0]   # (its prompt is in the prefix cache now)
        assert again.num_cached_tokens == 0 and run(llm, LONG_PROMPT, greedy(1))[0].num_cached_tokens > 0
        assert len(scoring) == len(again.prompt_token_ids) - 1
        with torch.inference_mode():
            ref = ref_model(torch.tensor([first.prompt_token_ids])).logits[0].log_softmax(-1)
        for out in (first, again):
            assert_prompt_logprobs_match(out, ref, k, llm.tokenizer)
            assert out.outputs[0].token_ids == alone[0].outputs[0].token_ids[:12]
        scoring.clear()
        two = run(llm, LONG_PROMPT, SamplingParams(n=2, max_tokens=2, seed=1, prompt_logprobs=k))[0]
        assert_prompt_logprobs_match(two, ref, k, llm.tokenizer)
        assert len(scoring) == len(two.prompt_token_ids) - 1 and set(scoring) == {f"{two.request_id}#0"}
        assert run(llm, LONG_PROMPT, greedy(2))[0].prompt_logprobs is None
        assert_engine_idle(llm)
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]   # (no step failed)


def test_prompt_logprobs_survive_preemption(llama_dir):
    """Requests preempted (recomputed) while or after their prompt is scored keep one entry per
    prompt token, each as transformers scores it."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=24, block_size=8, max_num_batched_tokens=24,
              enable_prefix_caching=False)
    prompts = [f"{word}: " + LONG_PROMPT for word in ("one", "two", "three", "four", "five", "six")]
    outs = run(llm, prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=1))
    assert llm.engine.scheduler.num_preemptions > 0
    ref_model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    for out in outs:
        with torch.inference_mode():
            ref = ref_model(torch.tensor([out.prompt_token_ids])).logits[0].log_softmax(-1)
        assert_prompt_logprobs_match(out, ref, 1, llm.tokenizer)
    assert_engine_idle(llm)


# ---------------------------------------------------------------- chat


def test_chat_renders_the_template(llm):
    tok = llm.tokenizer
    conversations = [
        [{"role": "user", "content": "What is the weather today?"}],
        [{"role": "system", "content": "You count."}, {"role": "user", "content": "one, two,"}],
    ]
    singles = []
    for conv in conversations:
        out = llm.chat(conv, greedy(8), use_tqdm=False)
        assert len(out) == 1
        text = tok.apply_chat_template(conv, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n") and conv[-1]["content"] in text
        assert out[0].prompt == text
        assert out[0].prompt_token_ids == tok.encode(text)
        assert out[0].prompt_token_ids[0] == BOS and out[0].prompt_token_ids[1] != BOS
        # The reply is what generate() gives for the rendered prompt.
        assert out[0].outputs[0].token_ids == run(llm, [out[0].prompt_token_ids], greedy(8))[0].outputs[0].token_ids
        singles.append(out[0])
    both = llm.chat(conversations, greedy(8), use_tqdm=False)
    assert [o.prompt_token_ids for o in both] == [o.prompt_token_ids for o in singles]
    assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in singles]
    assert singles[0].outputs[0].token_ids != singles[1].outputs[0].token_ids


def test_chat_continues_the_final_assistant_message(llm):
    """continue_final_message (vLLM's and transformers' name): the conversation rendered without a
    generation prompt and cut right after the final (assistant) message's text, so the model
    continues that message instead of starting a new turn."""
    tok = llm.tokenizer
    prefix = "one, two, three,"
    conv = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": prefix}]
    out = llm.chat(conv, greedy(8), use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    whole = tok.apply_chat_template(conv, add_generation_prompt=False)
    assert out.prompt == whole[:whole.rindex(prefix) + len(prefix)] and whole != out.prompt
    assert out.prompt_token_ids == tok.encode(out.prompt)
    assert out.outputs[0].token_ids == run(llm, [out.prompt_token_ids], greedy(8))[0].outputs[0].token_ids
    # (this template keeps the message as it is: its spaces too, the trailing one included)
    spaced = [conv[0], {"role": "assistant", "content": "  " + prefix + " "}]
    assert llm.chat(spaced, greedy(1), use_tqdm=False, add_generation_prompt=False,
                    continue_final_message=True)[0].prompt.endswith("assistant\n  " + prefix + " ")
    for short in ("<", "im", "end", ">"):   # (texts the template's own markup holds too)
        prompt = llm.chat([conv[0], {"role": "assistant", "content": short}], greedy(1), use_tqdm=False,
                          add_generation_prompt=False, continue_final_message=True)[0].prompt
        assert prompt.endswith("<|im_start|>assistant\n" + short), prompt
    with pytest.raises(TokenmillError, match="continue_final_message.*add_generation_prompt"):
        llm.chat(conv, greedy(1), use_tqdm=False, continue_final_message=True)
    with pytest.raises(TokenmillError, match="continue_final_message.*assistant"):
        llm.chat(conv[:1], greedy(1), use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(TokenmillError, match="continue_final_message: the final message is empty"):
        llm.chat([conv[0], {"role": "assistant", "content": " "}], greedy(1), use_tqdm=False,
                 add_generation_prompt=False, continue_final_message=True)


def test_chat_adds_bos_only_when_the_template_does_not(llama_dir, tmp_path):
    conv = [{"role": "user", "content": "hello"}]
    # A tokenizer that adds BOS to every encode(); the ChatML template already starts with it.
    bos_dir = _copy_folder(llama_dir, tmp_path / "bos", {"add_bos_token": True})
    llm = LLM(str(bos_dir), dtype="float32")
    tok = llm.tokenizer
    assert tok.encode("hello")[:1] == [BOS] and run(llm, "hello", greedy(2))[0].prompt_token_ids[:1] == [BOS]
    text = tok.apply_chat_template(conv)
    assert text.startswith("<|im_start|>")
    ids = llm.chat(conv, greedy(2), use_tqdm=False)[0].prompt_token_ids
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == BOS and ids[1] != BOS

    # A template that does not start with BOS gets one.
    plain_dir = _copy_folder(bos_dir, tmp_path / "plain")
    (plain_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:", encoding="utf-8")
    llm = LLM(str(plain_dir), dtype="float32")
    text = llm.tokenizer.apply_chat_template(conv)
    assert text == "user: hello\nassistant:"
    ids = llm.chat(conv, greedy(2), use_tqdm=False)[0].prompt_token_ids
    assert ids == [BOS] + llm.tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- stream


def test_stream_grows_to_the_generate_output(llm):
    stop_prompt, _, _, stop, _ = _stop_across_tokens(llm)
    for prompt, params in ((PROMPTS[3], greedy(12)), (stop_prompt, greedy(40, stop=stop))):
        expected = run(llm, prompt, params)[0].outputs[0]
        partials = list(llm.stream(prompt, params))
        texts = [p.outputs[0].text for p in partials]
        counts = [len(p.outputs[0].token_ids) for p in partials]
        assert counts == list(range(1, len(expected.token_ids) + 1))  # one yield per new token
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
        assert len(set(texts)) > 2
        assert [p.finished for p in partials] == [False] * (len(partials) - 1) + [True]
        assert texts[-1] == expected.text and partials[-1].outputs[0].token_ids == expected.token_ids
        assert partials[-1].outputs[0].finish_reason == expected.finish_reason
        assert partials[-1].prompt_token_ids == llm.tokenizer.encode(prompt)
    assert_engine_idle(llm)


def test_stream_messages_matches_chat(llm):
    conv = [{"role": "user", "content": "Tell me a story"}]
    expected = llm.chat(conv, greedy(10), use_tqdm=False)[0]
    last = list(llm.stream(messages=conv, sampling_params=greedy(10)))[-1]
    assert last.prompt_token_ids == expected.prompt_token_ids
    assert last.outputs[0].token_ids == expected.outputs[0].token_ids
    assert last.outputs[0].text == expected.outputs[0].text


def test_abandoned_stream_frees_its_request(llm):
    expected = run(llm, PROMPTS[0], greedy(10))[0].outputs[0].token_ids
    stream = llm.stream(PROMPTS[0], greedy(30))
    assert len(next(stream).outputs[0].token_ids) == 1
    next(stream)
    stream.close()
    assert_engine_idle(llm)
    assert run(llm, PROMPTS[0], greedy(10))[0].outputs[0].token_ids == expected


# ---------------------------------------------------------------- generation_config defaults


def test_default_sampling_params_come_from_generation_config(llm, llama_dir, tmp_path):
    assert llm.get_default_sampling_params() == SamplingParams()  # the tiny config has no sampling values

    sampled_dir = _copy_folder(llama_dir, tmp_path / "sampled")
    config = json.loads((sampled_dir / "generation_config.json").read_text(encoding="utf-8"))
    config.update(do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=2.0)
    (sampled_dir / "generation_config.json").write_text(json.dumps(config), encoding="utf-8")
    defaults = LLM(str(sampled_dir), dtype="float32").get_default_sampling_params()
    assert defaults == SamplingParams(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=2.0)

    greedy_dir = _copy_folder(llama_dir, tmp_path / "greedy")
    config.update(do_sample=False)
    (greedy_dir / "generation_config.json").write_text(json.dumps(config), encoding="utf-8")
    greedy_llm = LLM(str(greedy_dir), dtype="float32")
    assert greedy_llm.get_default_sampling_params().temperature == 0.0
    # generate() without sampling_params uses those defaults: greedy, 16 tokens, the repetition
    # penalty (which changes this prompt's greedy continuation: it repeats a prompt token).
    out = run(greedy_llm, PROMPTS[3])[0].outputs[0]
    reference = run(llm, PROMPTS[3], SamplingParams(temperature=0.0, top_p=0.9, top_k=20,
                                                    repetition_penalty=2.0))[0].outputs[0]
    assert out.token_ids == reference.token_ids and len(out.token_ids) == 16
    assert out.token_ids != run(llm, PROMPTS[3], SamplingParams(temperature=0.0))[0].outputs[0].token_ids


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def default_llm(default_gguf_path) -> LLM:
    return LLM(str(default_gguf_path), dtype="float32")


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(default_gguf_path):
    # the dequantized reference path (transformers dequantizes too); the default, quantized
    # execution is compared with it in test_quant.py
    llm = LLM(str(default_gguf_path), dtype="float32", quantization="none")
    prompts = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    ref_model = AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, dtype=torch.float32).eval()
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                     min_new_tokens=24, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), out.prompt
        assert len(set(out.outputs[0].token_ids)) > 8  # a real continuation, not one repeated token


@pytest.mark.slow
def test_default_model_chat_answers_and_stops_on_eos(default_llm):
    tok = default_llm.tokenizer
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    out = default_llm.chat(conv, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert c.token_ids[-1] in tok.eos_token_ids and len(c.token_ids) < 64
    assert "Paris" in c.text
    text = tok.apply_chat_template(conv, add_generation_prompt=True)
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids[0] == tok.bos_token_id and out.prompt_token_ids[1] != tok.bos_token_id
