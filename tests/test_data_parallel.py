"""Data parallelism: `tokenmill serve --data-parallel-size 2` (two engine replicas behind one front
end, server/frontend.py) answers exactly as one engine does, routes a repeated prefix to the
replica that cached it (seen in the replicas' own metrics), survives a replica's death, and leaves
no process behind. The router's policy and the metrics' aggregation are also tested alone."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_server import Server, running

from tokenmill.config import EngineConfig
from tokenmill.errors import TokenmillError
from tokenmill.server.command import replica_roles
from tokenmill.server.frontend import AggregatedMetrics, routing_text
from tokenmill.server.router import CHUNK_CHARS, CacheAwareRouter, chunk_keys

FLAGS = ["--dtype", "float32", "--threads", "1", "--max-model-len", "512", "--num-kv-blocks", "96"]
APP_ORIGIN = "http://app.example"


# --- the router alone ------------------------------------------------------------------------------

def test_chunk_keys_chain_the_whole_prefix():
    a = chunk_keys("x" * CHUNK_CHARS + "y" * CHUNK_CHARS + "tail")
    b = chunk_keys("x" * CHUNK_CHARS + "z" * CHUNK_CHARS)
    assert len(a) == 2 and len(chunk_keys("x" * (CHUNK_CHARS - 1))) == 0
    assert a[0] == b[0] and a[1] != b[1]
    # the key of a chunk depends on what came before it, not only on its own text
    assert chunk_keys("q" * CHUNK_CHARS + "y" * CHUNK_CHARS)[1] != a[1]


def test_router_prefers_the_replica_holding_the_prefix():
    router = CacheAwareRouter(2)
    shared = "system prompt " * 20
    first = router.choose(shared + "question one", {0: 0, 1: 0})
    assert first.reason == "load"
    other = 1 - first.replica
    # the other replica is now the less loaded one, but the prefix is cached where the first went
    second = router.choose(shared + "question two", {first.replica: 1, other: 0})
    assert (second.replica, second.reason) == (first.replica, "cache")
    assert second.matched_chars >= len(shared) - CHUNK_CHARS
    # an unrelated prompt goes by load
    assert router.choose("something else entirely " * 5, {first.replica: 2, other: 0}) .replica == other


def test_router_gives_way_to_load_when_out_of_balance():
    router = CacheAwareRouter(2, balance_abs=4, balance_rel=1.5)
    shared = "a long shared prefix " * 20
    home = router.choose(shared, {0: 0, 1: 0}).replica
    away = 1 - home
    assert router.choose(shared + "1", {home: 4, away: 0}).replica == home   # 4 - 0 is not > 4
    busy = router.choose(shared + "2", {home: 9, away: 2})
    assert (busy.replica, busy.reason) == (away, "load")
    router.forget(home)   # a restarted replica's cache is empty
    assert router.indexes[home].match(chunk_keys(shared)) == 0


def test_router_index_is_bounded_lru():
    router = CacheAwareRouter(1, max_entries=4)
    router.choose("a" * CHUNK_CHARS * 3, {0: 0})
    router.choose("b" * CHUNK_CHARS * 3, {0: 0})
    assert len(router.indexes[0].entries) == 4
    assert router.indexes[0].match(chunk_keys("b" * CHUNK_CHARS * 3)) == 3
    assert router.indexes[0].match(chunk_keys("a" * CHUNK_CHARS * 3)) == 0   # its head was evicted


def test_routing_text():
    assert routing_text({"prompt": "hello"}) == "hello"
    assert routing_text({"prompt": [1, 2, 3]}) == "[1, 2, 3]"
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    longer = messages + [{"role": "assistant", "content": "a"}]
    assert routing_text({"messages": longer}).startswith(routing_text({"messages": messages})[:-1])
    assert routing_text("not a dict") == routing_text({}) == ""


def test_aggregated_metrics_label_replicas_and_sum():
    def text(hits: float, queries: float, running: float) -> str:
        return (f"# TYPE tokenmill_prefix_cache_hits counter\ntokenmill_prefix_cache_hits_total {hits}\n"
                f"# TYPE tokenmill_prefix_cache_queries counter\ntokenmill_prefix_cache_queries_total {queries}\n"
                f"# TYPE tokenmill_prefix_cache_hit_rate gauge\ntokenmill_prefix_cache_hit_rate "
                f"{hits / queries}\n# TYPE tokenmill_num_requests_running gauge\n"
                f"tokenmill_num_requests_running {running}\n")

    samples = {(s.name, s.labels["replica"]): s.value
               for family in AggregatedMetrics({0: text(10, 100, 1), 1: text(30, 50, 2)}).collect()
               for s in family.samples}
    assert samples[("tokenmill_prefix_cache_hits_total", "0")] == 10
    assert samples[("tokenmill_prefix_cache_hits_total", "all")] == 40
    assert samples[("tokenmill_num_requests_running", "all")] == 3
    assert samples[("tokenmill_prefix_cache_hit_rate", "1")] == pytest.approx(0.6)
    assert samples[("tokenmill_prefix_cache_hit_rate", "all")] == pytest.approx(40 / 150)   # not 0.1 + 0.6


def test_a_request_a_replica_refused_to_connect_goes_to_another():
    """Between a replica's death and the supervisor noticing (its next poll), the router may still
    pick it: a refused connection means the request never started, so it goes to another replica."""
    from starlette.requests import Request

    from tokenmill.server.config import ServerConfig
    from tokenmill.server.frontend import FrontEnd
    from tokenmill.server.protocol import ErrorBody
    from tokenmill.server.replicas import Replica

    config = ServerConfig(model="m.gguf", served_model_name="m")
    replicas = [Replica(i, config, "both", 1.0, "warning") for i in range(2)]
    for r in replicas:
        r.up = True
    front = FrontEnd(config, replicas, lambda: None, lambda message: None)
    reached = []

    def transport(request: httpx.Request) -> httpx.Response:
        if request.url.port == replicas[0].port:
            raise httpx.ConnectError("connection refused", request=request)
        reached.append((request.url.port, request.url.path, request.content))
        return httpx.Response(200, json={"ok": True})

    async def call(path: str) -> int:
        body = b'{"prompt": "hi"}'
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await asyncio.Event().wait()   # (the client stays)

        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": [(b"content-type", b"application/json")]}
        front.client = httpx.AsyncClient(transport=httpx.MockTransport(transport))
        replicas[0].in_flight = -1   # (the least loaded: the router's choice, and the first up)
        request = Request(scope, receive)
        response = await (front.generate(request) if path == "/v1/completions" else
                          front.relay(front.first_up(), request, body, counted=False, retry=True))
        await response.upstream.aclose()
        await front.client.aclose()
        return response.status_code

    assert asyncio.run(call("/v1/completions")) == 200
    assert asyncio.run(call("/tokenize")) == 200
    replicas[1].up = False   # (no other replica: the refusal is the answer)
    with pytest.raises(ErrorBody, match="replica 0 did not answer"):
        asyncio.run(call("/v1/completions"))
    assert reached == [(replicas[1].port, "/v1/completions", b'{"prompt": "hi"}'),
                       (replicas[1].port, "/tokenize", b'{"prompt": "hi"}')]
    # the refused attempts gave their load back; the generation relay (never run here) still counts
    assert replicas[0].in_flight == -1 and replicas[1].in_flight == 1


def test_replica_roles_and_refusals():
    kv = {"kv_connector": "SharedMemoryConnector"}
    assert replica_roles(1, EngineConfig()) == []
    assert replica_roles(3, EngineConfig()) == ["both"] * 3
    assert replica_roles(1, EngineConfig(kv_transfer_config=kv)) == ["prefill", "decode"]
    # an engine in one role is a single server (another proxy pairs it), or its replicas
    assert replica_roles(1, EngineConfig(kv_transfer_config={**kv, "kv_role": "kv_consumer"})) == []
    assert replica_roles(2, EngineConfig(kv_transfer_config={**kv, "kv_role": "kv_producer"})) == ["both"] * 2
    with pytest.raises(TokenmillError, match="--data-parallel-size"):
        replica_roles(0, EngineConfig())
    for many in (513, 2**63):   # (a process each: 2**63 was an OverflowError)
        with pytest.raises(TokenmillError, match="--data-parallel-size: must be at most 512"):
            replica_roles(many, EngineConfig())
    with pytest.raises(TokenmillError, match="does not combine"):
        replica_roles(2, EngineConfig(kv_transfer_config=kv))
    for config, words in [({"kv_connector": "Nixl"}, "is not one of"), ({**kv, "x": 1}, "unknown key.*'x'"),
                          ({**kv, "kv_role": "kv_both"}, "kv_role"), ({}, "kv_connector is required"),
                          ("{not json", "not a JSON object")]:
        with pytest.raises(TokenmillError, match=words):
            EngineConfig(kv_transfer_config=config)
    with pytest.raises(TokenmillError, match="tensor_parallel_size"):
        EngineConfig(kv_transfer_config=kv, tensor_parallel_size=2)


# --- two replicas, run for real ----------------------------------------------------------------------

def labelled(base: str) -> dict[tuple[str, str], float]:
    """/metrics samples by (name with its labels but replica, replica)."""
    out = {}
    for m in re.finditer(r"^(tokenmill_[^\s{]+)(?:\{([^}]*)\})? (\S+)$", httpx.get(base + "/metrics").text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        replica = labels.pop("replica", "")
        name = m.group(1) + "".join(f",{k}={v}" for k, v in sorted(labels.items()))
        out[(name, replica)] = float(m.group(3))
    return out


def health(base: str) -> dict:
    return httpx.get(base + "/health", timeout=10).json()


@pytest.fixture(scope="module")
def servers(default_gguf_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("dp")
    # (--root-path: the front end relays paths without it, as its replicas serve them)
    dp = Server([str(default_gguf_path), *FLAGS, "--data-parallel-size", "2", "--allowed-origins", APP_ORIGIN,
                 "--root-path", "/llm"], logs / "dp2.log")
    single = Server([str(default_gguf_path), *FLAGS], logs / "dp1.log")
    with running(dp, None), running(single, None):
        yield dp, single


def _answers(base: str, model: str) -> list:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    out = []
    for prompt in ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]:
        out.append(client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0).choices[0].text)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name three colours."}],
                                          max_tokens=24, temperature=0)
    out.append(chat.choices[0].message.content)
    stream = client.completions.create(model=model, prompt="Water boils at", max_tokens=16, temperature=0,
                                       stream=True)
    out.append("".join(c.choices[0].text for c in stream if c.choices))
    seeded = client.completions.create(model=model, prompt="A list of fruits:", max_tokens=16, temperature=0.9,
                                       seed=7, n=2)
    out.append(sorted(c.text for c in seeded.choices))
    return out


@pytest.mark.slow
def test_dp2_answers_equal_dp1(servers, default_gguf_path):
    dp, single = servers
    model = default_gguf_path.name
    assert health(dp.base)["status"] == "ok" and len(health(dp.base)["replicas"]) == 2
    assert _answers(dp.base, model) == _answers(single.base, model)


@pytest.mark.slow
def test_repeated_prefix_goes_to_the_replica_that_cached_it(servers, default_gguf_path):
    dp, _ = servers
    client = openai.OpenAI(base_url=dp.base + "/v1", api_key="none", max_retries=0)
    prefix = f"Session {uuid.uuid4().hex}. " + "You are a careful assistant who answers in one short sentence. " * 6
    before = labelled(dp.base)
    for question in ["What is 2 + 2?", "What colour is the sky?", "Who wrote Hamlet?", "Where is Peru?"]:
        client.completions.create(model=default_gguf_path.name, prompt=prefix + question, max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    after = labelled(dp.base)

    def delta(name: str, replica: str) -> float:
        return after.get((name, replica), 0.0) - before.get((name, replica), 0.0)

    routed = {r: {reason: delta(f"tokenmill_router_requests_total,reason={reason}", r) for reason in ("cache", "load")}
              for r in ("0", "1")}
    home = max(routed, key=lambda r: sum(routed[r].values()))
    away = "1" if home == "0" else "0"
    # the first went by load (nothing cached anywhere), the three others followed it by affinity
    assert routed[home] == {"cache": 3, "load": 1} and routed[away] == {"cache": 0, "load": 0}
    # and the replicas' own engines agree: the home replica served 4 requests and found the prefix cached
    assert delta("tokenmill_requests_total,status=length", home) == 4
    assert delta("tokenmill_requests_total,status=length", away) == 0
    assert delta("tokenmill_prefix_cache_hits_total", home) >= 3 * 64   # (at least 4 blocks of 16, 3 times)
    assert delta("tokenmill_prefix_cache_hits_total", away) == 0
    total = delta("tokenmill_prefix_cache_hits_total", "all")
    assert total == delta("tokenmill_prefix_cache_hits_total", home)


def _stream_text(base: str, model: str, prompt: str, max_tokens: int, started: threading.Event) -> tuple[str, str]:
    """(text, how it ended: "done", or the error event's message)."""
    text = []
    with httpx.stream("POST", base + "/v1/completions", timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return "".join(text), "done"
            if line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "".join(text), chunk["error"]["message"]
                text.append(chunk["choices"][0]["text"])
                started.set()
    return "".join(text), "cut"


@pytest.mark.slow
def test_a_dead_replica_is_restarted_and_the_other_replicas_requests_finish(servers, default_gguf_path):
    dp, _ = servers
    model = default_gguf_path.name
    with ThreadPoolExecutor(2) as pool:
        events = [threading.Event(), threading.Event()]
        futures = [pool.submit(_stream_text, dp.base, model, f"Story number {i}: it was a dark and stormy night",
                               200, events[i]) for i in range(2)]
        for e in events:
            assert e.wait(60)
        replicas = health(dp.base)["replicas"]
        assert [r["in_flight"] for r in replicas] == [1, 1]   # one stream each (by load: nothing shared)
        victim = replicas[0]
        os.kill(victim["pid"], signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
    # the victim's stream ends with an error event, promptly; the other one gets all its tokens
    endings = sorted(how for _, how in results)
    assert endings[0] == "done" and "replica 0 failed" in endings[1], endings
    # meanwhile the front end keeps answering, on the live replica
    client = openai.OpenAI(base_url=dp.base + "/v1", api_key="none", max_retries=0)
    assert client.completions.create(model=model, prompt="Hello", max_tokens=4).choices[0].text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = health(dp.base)["replicas"][0]
        if state["up"] and state["restarts"] == 1:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"replica 0 was not restarted: {health(dp.base)}")
    assert state["pid"] != victim["pid"]
    assert labelled(dp.base)[("tokenmill_replica_restarts_total", "0")] == 1


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_front_end_killed_leaves_no_replica(default_gguf_path, tmp_path):
    s = Server([str(default_gguf_path), *FLAGS, "-dp", "2"], tmp_path / "dp.log")
    with running(s, None):
        pids = [r["pid"] for r in health(s.base)["replicas"]]
        s.proc.kill()
        s.proc.wait()
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_gone(p) for p in pids)


def test_a_replica_that_cannot_load_fails_the_server(default_gguf_path, tmp_path):
    # passes the flag checks, fails in the replicas' engines: the model's context is 8192
    s = Server([str(default_gguf_path), "--max-model-len", "100000", "-dp", "2"], tmp_path / "bad.log")
    try:
        code = s.proc.wait(120)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    assert code == 1
    log = s.log()
    assert "exceeds the model's context length" in log and "before it was ready" in log


@pytest.mark.slow
def test_the_front_end_answers_cross_origin_requests_once(servers):
    """CORS is the front end's: it answers the preflight, and a relayed answer carries its header
    once; the replicas, which only it talks to (on ports of their own), allow no other origin."""
    from tokenmill.server.config import ServerConfig
    from tokenmill.server.frontend import replica_config

    config = ServerConfig(model="m.gguf", served_model_name="m", allowed_origins=[APP_ORIGIN],
                          engine_args={"kv_transfer_config": {"kv_connector": "SharedMemoryConnector"}})
    assert replica_config(config, "both").allowed_origins == [] == replica_config(config, "prefill").allowed_origins
    dp, _ = servers
    r = httpx.options(dp.base + "/v1/completions", headers={"Origin": APP_ORIGIN,
                                                            "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    r = httpx.post(dp.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"Origin": APP_ORIGIN},
                   timeout=60)
    assert r.status_code == 200 and r.headers.get_list("access-control-allow-origin") == [APP_ORIGIN]


@pytest.mark.slow
def test_hostile_bodies_get_the_replicas_errors(servers):
    dp, _ = servers
    for body, status in [(b'{"prompt":' + b"[" * 100000 + b"]" * 100000 + b"}", 400),   # too deep for json
                         (b'{"prompt": ', 400), (b"[1, 2]", 400), (b'{"prompt": "\xff"}', 400),
                         (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413)]:
        r = httpx.post(dp.base + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == status and r.json()["error"]["message"], (body[:20], r.text[:200])
    assert health(dp.base)["status"] == "ok"


@pytest.mark.slow
def test_what_the_front_end_cannot_pass_on_is_a_4xx_not_a_500(servers):
    """Inputs Python's JSON parser or httpx took differently from the replicas (found by a hostile
    sweep: each was a 500 with a traceback in the front end's log)."""
    dp, _ = servers
    surrogate = b'{"prompt": "\\ud800' + b"a" * (2 * CHUNK_CHARS) + b'", "max_tokens": 2}'   # (hashed by the router)
    r = httpx.post(dp.base + "/v1/completions", content=surrogate, timeout=60)
    assert r.status_code == 400, r.text
    r = httpx.post(dp.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60,
                   headers={"User-Agent": "b\xe9ta".encode("latin-1"), "X-Raw": b"\xff\xfe"})
    assert r.status_code == 200, r.text
    # a head just under 16 KB (the front end's limit) passes the relay, whose own headers push it past 16 KB
    # (the replicas take twice that); a larger one is refused, by the front end's parser (400) if it came in
    # pieces, else before relaying (431): never a replica closing the connection (a 502)
    for size, statuses in ((15, (200,)), (20, (400, 431))):
        big = {f"X-Big-{i}": "b" * 1024 for i in range(size)}
        r = httpx.post(dp.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=big, timeout=60)
        assert r.status_code in statuses and (r.status_code == 200 or r.json()["error"]["message"]), r.text
    for path in ("/%00", "/v1/models/a%00b"):
        r = httpx.get(dp.base + path, timeout=60)
        assert r.status_code in (400, 404) and r.json()["error"]["message"], (path, r.text)
    assert health(dp.base)["status"] == "ok"


@pytest.mark.slow
def test_a_client_gone_before_a_non_streamed_answer_aborts_it_on_the_replica(servers):
    dp, _ = servers
    aborted = labelled(dp.base).get(("tokenmill_requests_total,status=abort", "all"), 0)
    for _ in range(2):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(dp.base + "/v1/completions", json={"prompt": "Tell me a long story", "max_tokens": 480,
                                                          "ignore_eos": True}, timeout=1)
    deadline = time.monotonic() + 20   # (480 tokens take longer than that here; an abort takes about a second)
    while time.monotonic() < deadline and (labelled(dp.base).get(("tokenmill_num_requests_running", "all"), 0)
                                           or any(r["in_flight"] for r in health(dp.base)["replicas"])):
        time.sleep(0.2)
    assert labelled(dp.base)[("tokenmill_num_requests_running", "all")] == 0
    assert labelled(dp.base)[("tokenmill_requests_total,status=abort", "all")] - aborted == 2


@pytest.mark.slow
def test_other_routes_reach_one_replica_whatever_their_method(servers):
    dp, _ = servers
    # (a replica's answers: DELETE is relayed too, not refused by the front end with a 405)
    assert httpx.delete(dp.base + "/engine/burst").status_code == 403   # the replicas run without --allow-burst
    assert httpx.get(dp.base + "/engine").status_code == 200
    tokens = httpx.post(dp.base + "/tokenize", json={"prompt": "Hello there"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
