"""The web UI in a real browser: headless Chromium (Debian's `chromium`, which scripts/install.sh
--test installs) driven by Playwright, against `tokenmill serve` run for real.

The playground streams the API's greedy reply, stops mid-stream (the server aborts the request
and frees its blocks), renders model output as text where it holds HTML, and asks for the API key
of a server that has one; the engine page shows a burst filling, sharing and preempting the KV
pool, and the pool empty again after. Screenshots of both pages (desktop light, phone dark) go to
the test's temp folder. Without Chromium the tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_server import Server, running, wait_for

try:
    from playwright import sync_api
except ImportError:   # (scripts/install.sh --test installs it)
    sync_api = None
BROWSER = os.environ.get("TOKENMILL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if BROWSER is None or sync_api is None:
    MISSING = "the browser tests need Chromium and Playwright (scripts/install.sh --test installs both)"
    if os.environ.get("CI"):
        raise RuntimeError(MISSING)
    pytest.skip(MISSING, allow_module_level=True)

KEY = "web-test-key"
NUM_KV_BLOCKS = 64     # a burst of 16 requests of ~10 blocks each must preempt
TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def server(default_gguf_path, tmp_path_factory) -> Server:
    s = Server([str(default_gguf_path), "--max-model-len", "512", "--num-kv-blocks", str(NUM_KV_BLOCKS),
                "--allow-burst"], tmp_path_factory.mktemp("web") / "server.log")
    with running(s, None):
        yield s


@pytest.fixture(scope="module")
def keyed_server(tiny_gguf_model, tmp_path_factory) -> Server:
    s = Server([str(tiny_gguf_model("llama")), "--max-model-len", "256", "--api-key", KEY],
               tmp_path_factory.mktemp("web-key") / "server.log")
    with running(s, KEY):
        yield s


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=BROWSER, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture
def page(browser):
    """A fresh tab (a fresh context: no sessionStorage) whose script errors fail the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    # (the browser logs every 401 as an error: the API-key test has them by design)
    p.on("console", lambda m: errors.append(m.text) if m.type == "error" and "status of 401" not in m.text else None)
    p.set_default_timeout(TIMEOUT_MS)
    yield p
    context.close()
    assert errors == [], errors


def model_name(server: Server) -> str:
    return httpx.get(server.base + "/v1/models", timeout=10).json()["data"][0]["id"]


def open_playground(page, server: Server) -> None:
    page.goto(server.base + "/")
    page.wait_for_function("document.getElementById('model').textContent.startsWith('model: ')")


def chat(page, text: str, temperature: str = "0", max_tokens: str = "24") -> None:
    page.fill("#temperature", temperature)
    page.fill("#max_tokens", max_tokens)
    page.fill("#input", text)
    page.keyboard.press("Enter")   # (the input has the focus: Enter sends)


def last_reply(page):
    page.wait_for_selector("#messages article:last-child .stats")
    return page.locator("#messages article").last


def raw_text(reply) -> str:
    reply.get_by_role("button", name="Raw").click()
    return reply.locator(".content").text_content()


def test_serve_prints_the_pages_address(server):
    assert f"or open {server.base}/ in a browser (a chat playground; the engine, live: {server.base}/engine)" \
        in server.log()


def test_playground_streams_the_apis_greedy_reply(server, page, shots):
    question = "What is the capital of France? Answer in one sentence."
    expected = openai.OpenAI(base_url=server.base + "/v1", api_key="unused").chat.completions.create(
        model=model_name(server), messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24)
    open_playground(page, server)
    chat(page, question)
    reply = last_reply(page)
    stats = reply.locator(".stats").text_content()
    assert f"{expected.usage.completion_tokens} tokens" in stats and "tokens/s" in stats
    assert f"finish: {expected.choices[0].finish_reason}" in stats
    page.screenshot(path=shots / "playground.png")
    assert raw_text(reply) == expected.choices[0].message.content
    # Regenerate gives the same greedy reply again; Edit puts the question back in the box.
    reply.get_by_role("button", name="Regenerate").click()
    assert raw_text(last_reply(page)) == expected.choices[0].message.content
    page.locator("#messages article.user").get_by_role("button", name="Edit").click()
    assert page.input_value("#input") == question
    assert page.locator("#messages article").count() == 0


def test_stop_mid_stream_aborts_the_request_and_frees_its_blocks(server, page):
    before = server.metrics()
    open_playground(page, server)
    page.select_option("#mode", "completion")
    chat(page, "1, 2, 3, 4, 5, 6, 7, 8,", temperature="0", max_tokens="400")
    page.wait_for_function("document.querySelector('#messages article.streaming .content')?.textContent.length > 20")
    page.click("#stop")
    reply = last_reply(page)
    assert "finish: stopped" in reply.locator(".stats").text_content()
    assert wait_for(lambda: server.metrics()['tokenmill_requests_total{status="abort"}'] ==
                    before['tokenmill_requests_total{status="abort"}'] + 1)
    after = server.metrics()
    assert after["tokenmill_num_requests_running"] == 0 and after["tokenmill_kv_blocks_used"] == 0
    assert after["tokenmill_generation_tokens_total"] - before["tokenmill_generation_tokens_total"] < 400


def test_html_in_a_reply_renders_as_text(server, page):
    """The reply is forced (a JSON schema with one allowed string) to carry a script and an image
    with an onerror handler: both show as text, neither runs."""
    payload = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2"> **bold**'
    open_playground(page, server)
    page.fill("#schema", json.dumps({"type": "string", "enum": [payload]}))
    chat(page, "Say something.", max_tokens="64")
    reply = last_reply(page)
    content = reply.locator(".content")
    assert json.loads(raw_text(reply)) == payload
    reply.get_by_role("button", name="Rendered").click()
    text = content.text_content()
    assert "<script>window.pwned = 1</script>" in text and '<img src=x onerror="window.pwned = 2">' in text
    assert content.locator("script, img").count() == 0
    assert content.locator("strong").text_content() == "bold"   # (markdown still renders)
    assert page.evaluate("window.pwned") is None


def test_engine_page_shows_a_burst_fill_share_preempt_and_empty_the_pool(server, page, shots):
    page.set_viewport_size({"width": 1280, "height": 1800})
    page.goto(server.base + "/engine")
    page.wait_for_function("document.getElementById('feed-status').textContent === 'live'")
    page.wait_for_function("document.getElementById('n-total').textContent === '64'")
    assert page.text_content("#n-used") == "0"
    idle_grid = page.evaluate("document.getElementById('grid').toDataURL()")
    page.fill("#b-requests", "16")
    page.fill("#b-prompt", "100")
    page.fill("#b-output", "48")
    page.fill("#b-shared", "50")
    page.click("#burst-form button[type=submit]")
    page.wait_for_function("document.getElementById('burst-result').textContent.includes('16 requests sent')")
    seen = {"used": 0, "shared": 0, "running": 0}
    busy_grid = None
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        used, shared, running = (int(page.text_content(f"#{i}")) for i in ("n-used", "n-shared", "c-running"))
        if used > seen["used"]:
            busy_grid = page.evaluate("document.getElementById('grid').toDataURL()")
        seen = {"used": max(seen["used"], used), "shared": max(seen["shared"], shared),
                "running": max(seen["running"], running)}
        if seen["used"] > NUM_KV_BLOCKS // 2 and seen["shared"] > 0 and seen["running"] > 1:
            break
        time.sleep(0.1)
    assert seen["used"] > NUM_KV_BLOCKS // 2 and seen["shared"] > 0 and seen["running"] > 1, seen
    assert busy_grid != idle_grid
    page.screenshot(path=shots / "engine.png", full_page=True)
    assert page.locator("#requests tbody tr").count() > 0
    # All 16 finish: the pool holds nothing again (cached prefixes stay, evictable), and the pool
    # was too small for all of them at once, so some were preempted and recomputed.
    page.wait_for_function("document.getElementById('c-running').textContent === '0' && "
                           "document.getElementById('c-waiting').textContent === '0' && "
                           "document.getElementById('n-used').textContent === '0'")
    assert int(page.text_content("#c-preemptions")) > 0
    assert page.evaluate("document.getElementById('grid').toDataURL()") != busy_grid
    metrics = server.metrics()
    assert metrics["tokenmill_kv_blocks_used"] == 0 and metrics["tokenmill_num_requests_running"] == 0


def test_phone_width_and_dark_mode(server, browser, shots):
    context = browser.new_context(viewport={"width": 390, "height": 844}, color_scheme="dark", is_mobile=True)
    try:
        page = context.new_page()
        for path, name in (("/", "playground-phone-dark.png"), ("/engine", "engine-phone-dark.png")):
            page.goto(server.base + path)
            page.wait_for_timeout(1500)
            assert page.evaluate("document.documentElement.scrollWidth") <= 390, f"{path} scrolls sideways"
            background = page.evaluate("getComputedStyle(document.body).backgroundColor")
            assert background == "rgb(22, 23, 26)", background   # the dark palette
            page.screenshot(path=shots / name, full_page=True)
        page.goto(server.base + "/")
        assert not page.is_visible("#settings")   # folded away on a phone, one button to open it
        page.click("#settings-toggle")
        assert page.is_visible("#temperature")
    finally:
        context.close()


def test_the_pages_work_behind_a_proxy_under_a_path_prefix(server, page):
    """A reverse proxy serving the server under /llm/ (stripping the prefix) is played by the page's
    request router: the pages' files and API calls must all go under the prefix."""
    prefix = server.base + "/llm/"
    elsewhere: list[str] = []

    def proxy(route) -> None:
        url = route.request.url
        if not url.startswith(prefix):
            elsewhere.append(url)
            route.fulfill(status=404, body="not behind the proxy")
            return
        route.fulfill(response=route.fetch(url=server.base + "/" + url[len(prefix):]))

    page.route(server.base + "/**", proxy)
    page.goto(prefix)
    page.wait_for_function("document.getElementById('model').textContent.startsWith('model: ')")
    chat(page, "hi", max_tokens="4")
    assert "4 tokens" in last_reply(page).locator(".stats").text_content()
    assert page.locator("nav a", has_text="Engine").evaluate("a => a.href") == prefix + "engine"
    assert elsewhere == []


def test_api_key_is_asked_for_kept_in_the_tab_and_used(keyed_server, page, browser):
    page.goto(keyed_server.base + "/")
    dialog = page.locator("#key-dialog")
    dialog.wait_for(state="visible")
    dialog.locator("input").fill("wrong")
    dialog.get_by_role("button", name="Save").click()
    page.wait_for_function("document.querySelector('#key-dialog .reason').textContent.includes('refused')")
    dialog.locator("input").fill(KEY)
    page.keyboard.press("Enter")   # (the keyboard way: Enter in the field saves)
    page.wait_for_function("document.getElementById('model').textContent.startsWith('model: ')")
    chat(page, "hi", max_tokens="4")
    assert "4 tokens" in last_reply(page).locator(".stats").text_content()
    # The engine page in the same tab uses the key; another tab (context) does not have it.
    page.goto(keyed_server.base + "/engine")
    page.wait_for_function("document.getElementById('feed-status').textContent === 'live'")
    assert page.evaluate("sessionStorage.getItem('tokenmill-api-key')") == KEY
    other = browser.new_context().new_page()
    other.goto(keyed_server.base + "/")
    other.locator("#key-dialog").wait_for(state="visible")
    other.context.close()


def test_feed_and_burst_need_the_key_and_the_flag(keyed_server, server):
    assert httpx.get(keyed_server.base + "/engine/feed", timeout=10).status_code == 401
    assert httpx.get(keyed_server.base + "/engine", timeout=10).status_code == 200   # (the page holds no secret)
    r = httpx.post(keyed_server.base + "/engine/burst", json={"requests": 1, "prompt_tokens": 4, "output_tokens": 1},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 403 and "--allow-burst" in r.json()["error"]["message"]
    r = httpx.post(server.base + "/engine/burst", json={"requests": 1, "prompt_tokens": 500, "output_tokens": 100},
                   timeout=10)
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    r = httpx.post(server.base + "/engine/burst", json={"requests": 0, "prompt_tokens": 4, "output_tokens": 1},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "requests"
    r = httpx.post(server.base + "/engine/burst", json={"requests": 1, "prompt_tokens": 4, "output_tokens": 1,
                                                        "temperature": 1e300}, timeout=10)   # (once a 500)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


def test_sigterm_ends_an_open_feed_and_the_server_exits_at_once(tiny_gguf_model, tmp_path):
    """A feed never ends by itself: without the shutdown closing it, the drain would wait for it
    until --shutdown-timeout (60 s here)."""
    s = Server([str(tiny_gguf_model("llama")), "--max-model-len", "256", "--shutdown-timeout", "60"],
               tmp_path / "server.log")
    with running(s, None):
        with httpx.Client(timeout=30) as c, c.stream("GET", s.base + "/engine/feed") as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            s.proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            for _ in lines:
                pass
        assert s.proc.wait(30) == 0
        assert time.monotonic() - start < 15
