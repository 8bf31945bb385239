"""Prefill/decode disaggregation (engine/kv_transfer.py, server/frontend.py): a producer engine
prefills and exports a prompt's K/V, a consumer engine loads it and generates. Outputs equal a
colocated run, the consumer's cache holds the producer's K/V bit for bit, every block goes back
to its pool on both sides, and what cannot be used is refused or ignored with a reason."""

from __future__ import annotations

import dataclasses
import logging
import time

import httpx
import openai
import pytest
import torch
from test_data_parallel import FLAGS, health, labelled
from test_server import Server, running

from tokenmill import LLM, SamplingParams
from tokenmill.engine import kv_transfer
from tokenmill.errors import TokenmillError
from tokenmill.server.protocol import ErrorBody
from tokenmill.server.serving import check_export

KV = {"kv_connector": "SharedMemoryConnector"}
SHARED = kv_transfer.KV_DIR   # where servers started here put their transfers
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Hello", "One two three four five six seven"]


@pytest.fixture(autouse=True)
def kv_dir(tmp_path, monkeypatch):
    """This test's own transfer folder (what it leaves there is its own)."""
    monkeypatch.setattr(kv_transfer, "KV_DIR", tmp_path)
    return tmp_path


def _settings(**extra):
    return dict(dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16, **extra)


@pytest.fixture(scope="module")
def engines(tiny_gguf_model):
    path = str(tiny_gguf_model("llama"))
    producer = LLM(path, **_settings(kv_transfer_config={**KV, "kv_role": "kv_producer"}))
    consumer = LLM(path, **_settings(kv_transfer_config={**KV, "kv_role": "kv_consumer"}))
    colocated = LLM(path, **_settings())
    return producer, consumer, colocated


def _disaggregated(producer: LLM, consumer: LLM, prompt: list[int], params: SamplingParams):
    first = producer.generate(prompt, SamplingParams(max_tokens=1, temperature=0,
                                                     kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)[0]
    params = dataclasses.replace(params, kv_transfer_params=first.kv_transfer_params)
    return first, consumer.generate(prompt, params, use_tqdm=False)[0]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 40, 100])
def test_outputs_equal_colocated(engines, length):
    producer, consumer, colocated = engines
    prompt = _ids(length, length)
    for again, params in enumerate([SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                    SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True, n=2,
                                                   logprobs=2)]):
        loaded_before = consumer.engine.num_kv_loaded_tokens
        first, out = _disaggregated(producer, consumer, prompt, params)
        want = colocated.generate(prompt, params, use_tqdm=False)[0]
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in want.outputs]
        for got, ref in zip(out.outputs, want.outputs, strict=True):
            if got.logprobs is None:   # (the greedy pass asks for none)
                continue
            for token, a, b in zip(got.token_ids, got.logprobs, ref.logprobs, strict=True):
                assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)
        # the consumer computed only the last prompt token (a 1-token prompt has nothing to receive); the
        # second time, the prompt's full blocks are in its prefix cache already, and only the rest is received
        cached = (length - 1) // 16 * 16 if again else 0
        assert consumer.engine.num_kv_loaded_tokens - loaded_before == length - 1 - cached
        assert first.kv_transfer_params["remote_kv"].startswith("tokenmill-kv-")
    for llm in engines:   # every block is back in its pool (free, maybe still caching a prefix)
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
    assert not list(kv_transfer.KV_DIR.glob("tokenmill-kv-*"))   # and every transfer was collected


def test_under_chunked_prefill_preemption_and_speculation(tiny_gguf_model):
    """A 16-token step budget (the rest of the prompt is chunked after the load), a pool of 12 blocks
    (preemptions: a preempted consumer request recomputes what it had received) and ngram
    speculation on both sides."""
    path = str(tiny_gguf_model("llama"))
    tight = dict(max_num_batched_tokens=16, num_kv_blocks=12, max_model_len=96,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    producer = LLM(path, **_settings(kv_transfer_config={**KV, "kv_role": "kv_producer"}))
    consumer = LLM(path, **{**_settings(kv_transfer_config={**KV, "kv_role": "kv_consumer"}), **tight})
    colocated = LLM(path, **{**_settings(), **tight})
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True, n=2)
    prompts = [_ids(n, n) for n in (40, 33, 50)]
    firsts = [producer.generate(p, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                                use_tqdm=False)[0] for p in prompts]
    outs = consumer.generate(prompts, [dataclasses.replace(params, kv_transfer_params=f.kv_transfer_params)
                                       for f in firsts], use_tqdm=False)
    want = colocated.generate(prompts, params, use_tqdm=False)
    assert [[o.token_ids for o in out.outputs] for out in outs] == [[o.token_ids for o in w.outputs] for w in want]
    assert consumer.engine.scheduler.num_preemptions > 0 and consumer.engine.num_kv_loaded_tokens > 0
    assert consumer.engine.pool.num_free == consumer.engine.pool.num_blocks


@pytest.mark.parametrize("kind", ["gemma2", "phi3"])
def test_sliding_window_models_transfer_their_windows(tiny_gguf_model, kind):
    """Gemma 2 (a sliding and a global layer: two KV cache groups) and Phi-3 (every layer slides, window
    16): prefilled in chunks of 16, the producer's sliding layers hold only the blocks of their window
    when the prompt is done; the transfer carries those (zeros before them) and every position of the
    global layers, which is all the consumer reads. Outputs equal a colocated run."""
    path = str(tiny_gguf_model(kind))
    tight = dict(dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=4, max_num_batched_tokens=16)
    producer = LLM(path, **tight, kv_transfer_config={**KV, "kv_role": "kv_producer"})
    consumer = LLM(path, **tight, kv_transfer_config={**KV, "kv_role": "kv_consumer"})
    colocated = LLM(path, **tight)
    window = producer.engine.model_config.sliding_window
    sliding = [i for i in range(producer.engine.model_config.num_layers)
               if producer.engine.model_config.layer_slides(i)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for length in (5, 40, 100):
        prompt = _ids(length, length)
        first = producer.generate(prompt, SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={
            "do_remote_decode": True}), use_tqdm=False)[0]
        kv = torch.load(kv_transfer.KV_DIR / first.kv_transfer_params["remote_kv"], weights_only=True)["kv"]
        # the last chunk (of 16) starts at p and saw keys from p - window + 1 on: the
        # blocks before those were given back after the step before, and export as zeros
        released = max(0, (length - 1) // 16 * 16 - window + 1) // 4 * 4
        assert (kv[sliding, :, :released] == 0).all() and (released > 0) == (length > 16)
        assert (kv[sliding, :, released:] != 0).any(dim=-1).all()
        if len(sliding) < len(kv):   # the global layers: every position
            assert (kv[[i for i in range(len(kv)) if i not in sliding]] != 0).any(dim=-1).all()
        out = consumer.generate(prompt, dataclasses.replace(params, kv_transfer_params=first.kv_transfer_params),
                                use_tqdm=False)[0]
        assert out.outputs[0].token_ids == colocated.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert consumer.engine.num_kv_loaded_tokens == 4 + 39 + 99
    for llm in (producer, consumer, colocated):
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_consumer_cache_holds_the_producers_kv(engines):
    producer, consumer, _ = engines
    prompt = _ids(37, 99)
    first = producer.generate(prompt, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                              use_tqdm=False)[0]
    name = first.kv_transfer_params["remote_kv"]
    data = torch.load(kv_transfer.KV_DIR / name, weights_only=True)
    assert data["token_ids"].tolist() == prompt and data["kv"].shape[:3] == (len(producer.engine.kv_caches), 2, 37)
    engine = consumer.engine
    request = engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True,
                                                        kv_transfer_params=first.kv_transfer_params))
    assert not (kv_transfer.KV_DIR / name).exists()   # read once, then deleted
    before = time.monotonic()
    engine.step()   # admits it: the received K/V written into its blocks, the last token computed
    assert before <= engine.last_step.start <= time.monotonic()   # (the step's record is the step's)
    received = kv_transfer.slots(request.block_ids, engine.config.block_size, 0, 36)
    own = kv_transfer.slots(request.block_ids, engine.config.block_size, 36, 37)
    for layer, cache in enumerate(engine.kv_caches):
        assert torch.equal(cache[received], data["kv"][layer][:, :36])
        # the 37th is the consumer's own: computed in a 1-token step, against the received 36
        torch.testing.assert_close(cache[own], data["kv"][layer][:, 36:37])
    while engine.has_unfinished():
        engine.step()


def test_mismatched_or_missing_kv_is_computed_instead(engines, caplog):
    producer, consumer, colocated = engines
    prompt = _ids(30, 1)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = producer.generate(prompt, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                              use_tqdm=False)[0]
    other = _ids(30, 2)
    with_kv = dataclasses.replace(greedy, kv_transfer_params=first.kv_transfer_params)
    before = consumer.engine.num_kv_loaded_tokens
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        out = consumer.generate(other, with_kv, use_tqdm=False)[0]
    assert "not a prefix of this request's prompt" in caplog.text
    assert out.outputs[0].token_ids == colocated.generate(other, greedy, use_tqdm=False)[0].outputs[0].token_ids
    # gone (collected above): computed, quietly
    again = consumer.generate(prompt, with_kv, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == colocated.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert consumer.engine.num_kv_loaded_tokens == before


def test_unwritable_or_unreadable_transfers_fall_back_to_computing(engines, kv_dir, monkeypatch, caplog):
    producer, consumer, colocated = engines
    prompt = _ids(25, 5)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = colocated.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids

    def full(*args, **kwargs):
        (kv_dir / "partial").write_bytes(b"x")   # (what a full /dev/shm leaves: torch.save's path is args[1])
        args[1].write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="tokenmill"):
        m.setattr(kv_transfer.torch, "save", full)
        first = producer.generate(prompt, SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                                  use_tqdm=False)[0]
    assert first.kv_transfer_params is None and "No space left" in caplog.text
    assert [p.name for p in kv_dir.iterdir()] == ["partial"]   # the half-written export is gone
    (kv_dir / "partial").unlink()
    # an unreadable file: computed, with a warning, and deleted
    name = "tokenmill-kv-" + "ab" * 16
    (kv_dir / name).write_bytes(b"not a torch file")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        out = consumer.generate(prompt, dataclasses.replace(greedy, kv_transfer_params={"remote_kv": name}),
                                use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want and "unreadable" in caplog.text
    assert not list(kv_dir.iterdir())


def test_shutdown_deletes_uncollected_exports(tiny_gguf_model, kv_dir):
    producer = LLM(str(tiny_gguf_model("llama")), **_settings(kv_transfer_config={**KV, "kv_role": "kv_producer"}))
    producer.generate("nobody takes this", SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                      use_tqdm=False)
    assert len(list(kv_dir.iterdir())) == 1
    producer.engine.shutdown()
    assert not list(kv_dir.iterdir())


def test_refusals(engines, tiny_gguf_model):
    producer, consumer, colocated = engines
    with pytest.raises(TokenmillError, match="needs a kv_producer engine"):
        colocated.generate("hi", SamplingParams(kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)
    with pytest.raises(TokenmillError, match="needs a kv_consumer engine"):
        producer.generate("hi", SamplingParams(kv_transfer_params={"remote_kv": "tokenmill-kv-" + "0" * 32}),
                          use_tqdm=False)
    with pytest.raises(TokenmillError, match="not a KV transfer's name"):
        consumer.generate("hi", SamplingParams(kv_transfer_params={"remote_kv": "../../etc/passwd"}), use_tqdm=False)
    with pytest.raises(TokenmillError, match="kv_transfer_params"):
        SamplingParams(kv_transfer_params={"remote_kv": "x", "more": 1})
    with pytest.raises(TokenmillError, match="needs n = 1"):   # (each sample would export a copy)
        SamplingParams(n=2, kv_transfer_params={"do_remote_decode": True})
    export = SamplingParams(kv_transfer_params={"do_remote_decode": True})
    for stream, prompts in [(True, 1), (False, 2)]:   # the answer must name the one export
        with pytest.raises(ErrorBody, match="one prompt and stream false"):
            check_export(export, stream, prompts)
    check_export(export, False, 1)
    check_export(SamplingParams(), True, 3)
    # an engine of its own without a role (`tokenmill generate --kv-transfer-config ...`) was a plain
    # engine, the setting silently ignored
    with pytest.raises(TokenmillError, match="without a kv_role it describes `tokenmill serve`'s pair"):
        LLM(str(tiny_gguf_model("llama")), **_settings(kv_transfer_config=KV))


def test_an_export_checks_max_tokens_then_ends_after_one_token(engines, kv_dir):
    """The consumer will generate max_tokens: the producer refuses a prompt too long for them before
    computing it, and stops after the first token otherwise (the consumer samples every token)."""
    producer = engines[0]
    export = {"do_remote_decode": True}
    out = producer.generate(_ids(20, 1), SamplingParams(max_tokens=100, ignore_eos=True, kv_transfer_params=export),
                            use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.kv_transfer_params["remote_kv"]
    with pytest.raises(TokenmillError, match=r"max_tokens: prompt \(200 tokens\) \+ max_tokens \(100\) exceeds"):
        producer.generate(_ids(200, 2), SamplingParams(max_tokens=100, kv_transfer_params=export), use_tqdm=False)
    (kv_dir / out.kv_transfer_params["remote_kv"]).unlink()


def test_uncollected_exports_expire(engines, monkeypatch):
    producer = engines[0]
    params = SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    stale = producer.generate("never collected", params, use_tqdm=False)[0].kv_transfer_params["remote_kv"]
    assert (kv_transfer.KV_DIR / stale).exists()
    monkeypatch.setattr(kv_transfer, "EXPORT_TTL_S", -1.0)
    fresh = producer.generate("the next export", params, use_tqdm=False)[0].kv_transfer_params["remote_kv"]
    assert not (kv_transfer.KV_DIR / stale).exists()
    (kv_transfer.KV_DIR / fresh).unlink()


# --- the server: a prefill replica and a decode replica behind one front end ---------------------------

@pytest.mark.slow
def test_serve_disaggregated_equals_colocated(default_gguf_path, tmp_path):
    model = default_gguf_path.name
    pd = Server([str(default_gguf_path), *FLAGS, "--kv-transfer-config", '{"kv_connector": "SharedMemoryConnector"}'],
                tmp_path / "pd.log")
    single = Server([str(default_gguf_path), *FLAGS], tmp_path / "single.log")
    before = set(SHARED.glob("tokenmill-kv-*"))
    with running(pd, None), running(single, None):
        assert [r["role"] for r in health(pd.base)["replicas"]] == ["prefill", "decode"]
        answers = {}
        for s in (pd, single):
            client = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0)
            out = [client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0).choices[0].text
                   for p in PROMPTS]
            out.append(client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=16,
                temperature=0).choices[0].message.content)
            stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                               stream=True)
            out.append("".join(c.choices[0].text for c in stream if c.choices))
            out.append([c.text for c in client.completions.create(model=model, prompt=PROMPTS[1:], max_tokens=8,
                                                                   temperature=0).choices])
            # scoring the prompt: computed where it is scored (the decode replica), as colocated
            scored = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1)
            out.append(scored.choices[0].logprobs.token_logprobs)
            out.append(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                                 extra_body={"prompt_logprobs": 0}).model_dump()["choices"][0]
                       ["prompt_logprobs"])
            answers[s.base] = out
        assert answers[pd.base] == answers[single.base]
        # a bad request is refused once, with the prefill replica's 400
        bad = httpx.post(pd.base + "/v1/completions", json={"model": model, "prompt": "x", "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        # ... a prompt too long for its max_tokens too, before it is prefilled (the prefill leg keeps max_tokens)
        bad = httpx.post(pd.base + "/v1/completions", json={"model": model, "prompt": "word " * 400,
                                                            "max_tokens": 300})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "context_length_exceeded", bad.text
        # ... a head too large to relay too, before anything is exported
        bad = httpx.post(pd.base + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2},
                         headers={f"X-Big-{i}": "b" * 1024 for i in range(20)})
        assert bad.status_code in (400, 431), bad.text
        # ... or by the decode replica alone (the prefill leg leaves best_of out): its export is deleted
        bad = httpx.post(pd.base + "/v1/completions", json={"model": model, "prompt": "a prompt to export",
                                                            "max_tokens": 2, "best_of": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "best_of"
        deadline = time.monotonic() + 10   # (deleted once the relay is over, just after the answer went out)
        while set(SHARED.glob("tokenmill-kv-*")) - before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(SHARED.glob("tokenmill-kv-*")) <= before   # while both servers run (not by a shutdown)
        metrics = labelled(pd.base)
        # one export per request but the one with several prompts (the decode replica computed those) and the
        # ones the prefill replica refused
        assert metrics[("tokenmill_kv_transfer_exports_total,role=kv_producer", "0")] == 6
        assert metrics[("tokenmill_prompt_tokens_total", "0")] < 300   # (the refused long prompt never ran)
        assert metrics[("tokenmill_kv_transfer_loaded_tokens_total,role=kv_consumer", "1")] > 60
        # both sides gave every block back
        assert metrics[("tokenmill_kv_blocks_used", "0")] == metrics[("tokenmill_kv_blocks_used", "1")] == 0
        assert ("tokenmill_requests_total,status=length", "all") not in metrics   # (no double-counted sums)
    assert set(SHARED.glob("tokenmill-kv-*")) <= before   # every transfer collected or deleted
