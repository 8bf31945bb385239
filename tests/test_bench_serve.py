"""`tokenmill bench serve` end to end on a tiny model: it starts `tokenmill serve`, replays the
workload at each concurrency level, and every request completes with exactly the asked tokens.
No timing assertions."""

from __future__ import annotations

import argparse
import json

import pytest

from tokenmill.bench.serve import engine_argv, percentile, start_tokenmill, stop_process, wait_ready
from tokenmill.cli import build_parser, main


def test_bench_serve_measures_tokenmill_and_a_base_url_at_each_level(tiny_gguf_model, tmp_path, capsys):
    model = str(tiny_gguf_model("llama"))
    flags = ["--dtype", "float32", "--device", "cpu", "--max-num-seqs", "4"]
    # A server already running (here another tokenmill), measured through --base-url with an API key.
    peer_args = build_parser().parse_args(["bench", "serve", "--model", model, *flags])
    peer, peer_url = start_tokenmill(model, peer_args, tmp_path / "peer.log")
    try:
        wait_ready(peer_url, peer, 300)
        out = tmp_path / "serve.json"
        rc = main(["bench", "serve", "--model", model, *flags, "--num-requests", "6", "--input-len-range", "4", "16",
                   "--output-len-range", "2", "8", "--concurrency", "1", "3", "--base-url", peer_url,
                   "--output", str(out)])
    finally:
        assert stop_process(peer) == 0
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT p50/p90/p99 ms" in printed and "concurrency 3" in printed
    assert f"vs {peer_url} at concurrency 3" in printed
    report = json.loads(out.read_text())
    assert report["config"]["tokenmill_flags"] == flags
    rows = report["results"]
    assert [(r["target"], r["concurrency"]) for r in rows] == [("tokenmill", 1), ("tokenmill", 3), (peer_url, 1),
                                                               (peer_url, 3)]
    for r in rows:
        assert r["completed"] == 6 and r["failed"] == 0 and r["short_outputs"] == 0, r
        assert r["output_tokens"] == sum(report["output_lens"])
        assert r["output_tok_s"] > 0 and r["requests_per_s"] > 0
        assert r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"]
        assert r["e2e_p50_ms"] >= r["ttft_p50_ms"] > 0


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)


def test_engine_flags_pass_through_to_serve():
    args = build_parser().parse_args(["bench", "serve", "--no-enable-prefix-caching", "--block-size", "32",
                                      "--model", "m.gguf"])
    assert engine_argv(args) == ["--block-size", "32", "--no-enable-prefix-caching"]
    assert engine_argv(argparse.Namespace()) == []


def test_bench_serve_refuses_bad_options(tmp_path, capsys):
    for argv, words in ((["--concurrency", "0"], ["--concurrency"]), (["--request-rate", "-1"], ["--request-rate"]),
                        (["--no-tokenmill"], ["nothing to measure"]), (["--temperature", "-1"], ["--temperature"]),
                        (["--top-p", "0"], ["--top-p"]), (["--top-p", "1.5"], ["--top-p"]),
                        (["--top-p", "0.9"], ["--top-p", "greedy"]), (["--top-k", "40"], ["--top-k", "greedy"]),
                        (["--min-p", "0.05"], ["--min-p", "greedy"]),
                        (["--temperature", "1", "--top-k", "-1"], ["--top-k"]),
                        (["--temperature", "1", "--min-p", "1.5"], ["--min-p"]),
                        (["--llama-server", str(tmp_path / "nope")], ["--llama-server", "not an executable"])):
        rc = main(["bench", "serve", "--num-requests", "2", "--output", str(tmp_path / "x.json"), *argv])
        err = capsys.readouterr().err
        assert rc == 2 and all(w in err for w in words), err


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_a_token_that_renders_as_nothing_still_counts_as_streamed():
    """llama-server streams one chunk per token, with empty text for tokens that render as nothing
    (most of a random-weight model's): those are tokens, timed like any other; a stream with no
    token chunk at all is a failure."""
    import asyncio

    import httpx

    from tokenmill.bench.serve import stream_request

    def empty(finish=None):
        return {"choices": [{"text": "", "index": 0, "finish_reason": finish}]}

    usage = {"choices": [], "usage": {"completion_tokens": 3}}
    bodies = {"/tokens": _sse(empty(), empty(), empty("length"), usage), "/none": _sse(usage)}

    async def go(path):
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=bodies[request.url.path]))
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_request(client, "http://peer" + path, "m", [1, 2], 3, {}, 10.0)

    streamed = asyncio.run(go("/tokens"))
    assert streamed.ok and streamed.error is None and streamed.output_tokens == 3
    assert streamed.ttft_s is not None and len(streamed.itl_s) == 1   # two token chunks before the finish
    nothing = asyncio.run(go("/none"))
    assert not nothing.ok and nothing.error == "no token streamed"


def test_stream_lines_end_only_at_cr_and_lf():
    """A peer's JSON may hold U+2028, U+2029 or U+0085 raw (llama-server's does): SSE ends lines only
    at CR, LF and CRLF, so they stay inside their `data:` line; chunks may split anywhere, a CRLF too."""
    import asyncio

    import httpx

    from tokenmill.bench.serve import sse_lines, stream_request

    texts = ["a\u2028", "\u2029b", "\x85", "c"]
    events = [json.dumps({"choices": [{"text": t, "index": 0, "finish_reason": None}]}, ensure_ascii=False)
              for t in texts]
    body = "".join(f"data: {e}\r\n\r\n" for e in events) + "data: [DONE]\r\n\r\n"
    raw = body.encode()
    # every piece ends at a CR (so each CRLF is split) or after 7 bytes (splitting characters too)
    pieces = [part[i:i + 7] for part in raw.replace(b"\r", b"\r\0").split(b"\0") for i in range(0, len(part), 7)]

    async def chunks():
        for piece in pieces:
            yield piece

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=chunks()))
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_request(client, "http://peer/v1/completions", "m", [1, 2], 4, {}, 10.0)

    streamed = asyncio.run(go())
    assert streamed.error is None and streamed.ok and streamed.output_tokens == 4

    async def lines():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=chunks()))
        async with httpx.AsyncClient(transport=transport) as client, client.stream("GET", "http://peer/") as r:
            return [line async for line in sse_lines(r)]

    assert asyncio.run(lines()) == body.split("\r\n")[:-1]   # (no empty line where a chunk split a CRLF)


def test_requests_carry_the_asked_sampling():
    """Greedy by default; with --temperature, temperature, top_p, top_k and min_p, the filters sent
    even when off (so a llama-server does not add its own default filters)."""
    import asyncio

    import httpx

    from tokenmill.bench.serve import sampling_fields, stream_request

    sent = []

    def respond(request):
        sent.append(json.loads(request.content))
        return httpx.Response(200, content=_sse({"choices": [{"text": "a", "index": 0, "finish_reason": "length"}]}))

    async def go(sampling):
        async with httpx.AsyncClient(transport=httpx.MockTransport(respond)) as client:
            return await stream_request(client, "http://peer/v1/completions", "m", [1, 2], 1, {}, 10.0, sampling)

    assert asyncio.run(go(None)).ok and asyncio.run(go(sampling_fields(0.0, 0.5))).ok
    assert asyncio.run(go(sampling_fields(1.0, 0.95))).ok
    assert asyncio.run(go(sampling_fields(1.0, 0.95, 40, 0.05))).ok
    greedy, also_greedy, sampled, filtered = sent
    assert greedy["temperature"] == also_greedy["temperature"] == 0.0 and "top_p" not in greedy
    assert {k: sampled[k] for k in ("temperature", "top_p", "top_k", "min_p")} == \
        {"temperature": 1.0, "top_p": 0.95, "top_k": 0, "min_p": 0.0}
    assert {k: filtered[k] for k in ("temperature", "top_p", "top_k", "min_p")} == \
        {"temperature": 1.0, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
    assert sampled["max_tokens"] == 1 and sampled["ignore_eos"] and sampled["prompt"] == [1, 2]
