"""The playground (GET /): a real `specrt serve` of the default engines behind an API key, its page driven in a
headless Chromium (Debian's, through Playwright), each answer checked against the API's own for the same request.

One server for the file (a server's start is most of its time): started with --api-key, so every page asks for the
key first, and with no prefix cache, so that the page's request and the API's repeat of it run the same passes."""
from __future__ import annotations

import json
import re
import shutil
import urllib.error
import urllib.request

import pytest

from specrt.measurement.playground_shots import ask as send
from specrt.measurement.serve_bench import server

KEY = "sk-playground-3c9e"
PROMPT = "Name three colours."
METHOD, MAX_TOKENS = "eagle", 48   # EAGLE accepts about half its drafts on this prompt: rounds with drafts to mark


@pytest.fixture(scope="module")
def site(default_engines, tmp_path_factory):
    log = tmp_path_factory.mktemp("playground") / "server.log"
    with server(default_engines, log, "--api-key", KEY, "--prefix-cache", "0", wait_s=120) as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("no chromium on PATH: the playground's browser tests need Debian's (`apt-get install chromium`; "
                    "make test installs it where it runs as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing: pip install -e '.[test]'")
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=path)
        yield chromium
        chromium.close()


def get(url: str, key: str | None = None) -> tuple[int, str, str]:
    """(status, content type, body) of a GET."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return r.status, r.headers["content-type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["content-type"], e.read().decode()


def chat(url: str, method: str, max_tokens: int) -> dict:
    """The API's answer (not streamed) to the request the page makes for PROMPT at T = 0."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0,
            "specrt": {"method": method}}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def open_page(browser, url: str):
    """A fresh page (its own context: no storage shared with another test) past the key dialog, its methods loaded."""
    page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    page.goto(url + "/")
    page.wait_for_selector("#key-dialog[open]", timeout=15_000)
    page.fill("#key", KEY)
    page.click("#key-ok")
    page.wait_for_selector("body[data-ready='1']", timeout=15_000)
    return page


def ask(page, method: str, max_tokens: int, side_by_side: bool = False):
    """Send PROMPT at T = 0 (as the screenshots do) and wait until every answer of the turn (two side by side) has
    ended."""
    send(page, PROMPT, method, max_tokens, side_by_side)
    page.wait_for_function("() => { const a = document.querySelector('#turns .answer:last-of-type');"
                           " return a && [...a.querySelectorAll('.output')].every((o) => o.dataset.done); }",
                           timeout=120_000)
    assert not page.query_selector_all("#turns .error"), page.inner_text("#turns")
    return page.query_selector("#turns .answer:last-of-type")


def shown(output) -> dict:
    """What an answer's output shows: its text, its tokens' ids, how many are marked accepted, its final stats."""
    return output.evaluate("(o) => ({text: o.textContent, stats: JSON.parse(o.dataset.stats),"
                           " ids: [...o.querySelectorAll('.tok')].map((t) => Number(t.dataset.id)),"
                           " accepted: o.querySelectorAll('.tok.acc').length,"
                           " rounds: o.querySelectorAll('.round').length})")


def streamed_rounds(body: str) -> list[dict]:
    """The rounds (`specrt.rounds`) of a streamed answer's chunks, from its server-sent events as the page got them
    (the last chunk's `specrt` is the answer's figures, where `rounds` is a count)."""
    chunks = [json.loads(line[len("data: "):]) for line in body.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return [r for c in chunks if isinstance(c.get("specrt", {}).get("rounds"), list) for r in c["specrt"]["rounds"]]


def test_the_page_is_public_and_self_contained(site):
    """GET / needs no key and fetches nothing but the API (no script, style or font from elsewhere); the API still
    refuses a request without the key."""
    code, kind, html = get(site + "/")
    assert code == 200 and kind.startswith("text/html") and "<script>" in html, (code, kind)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html), "the page loads something from elsewhere"
    assert get(site + "/v1/models")[0] == 401 and get(site + "/v1/models", KEY)[0] == 200
    assert "/" not in json.loads(get(site + "/openapi.json", KEY)[2])["paths"]


def test_streamed_answer_is_the_apis_with_its_accepted_drafts_marked(site, browser):
    """(a) the text shown is the API's answer to the same request, token for token; (b) the spans marked as
    accepted drafts are each round's accepted drafts in the stream's `specrt.rounds`, token by token, as many as the
    accepted tokens of the stream's final stats; the figures show the method and a bar a draft
    position; hovering a round that accepted drafts says what it drafted and accepted."""
    page = open_page(browser, site)
    options = page.eval_on_selector_all("#method option", "(os) => os.map((o) => o.value)")
    models = json.loads(get(site + "/v1/models", KEY)[2])["data"][0]["specrt"]
    assert options[0] == "auto" and set(options) == set(models["methods"]) and METHOD in options
    with page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as response:
        answer = ask(page, METHOD, MAX_TOKENS)
    got = shown(answer.query_selector(".output"))
    want = chat(site, METHOD, MAX_TOKENS)
    # (b) token by token: each round's first `accepted` tokens marked, and no other (the target's own token is not)
    rounds = streamed_rounds(response.value.text())
    marks = answer.eval_on_selector_all(".output .round", "(rs) => rs.map((r) => [...r.querySelectorAll('.tok')]"
                                                          ".map((t) => [Number(t.dataset.id), t.matches('.acc')]))")
    assert marks == [[[t, i < r["accepted"]] for i, t in enumerate(r["tokens"])] for r in rounds]
    assert any(0 < r["accepted"] < len(r["tokens"]) for r in rounds)   # rounds with both kinds of token
    assert got["text"] == want["choices"][0]["message"]["content"]
    assert got["ids"] == want["choices"][0]["token_ids"] and len(got["ids"]) == MAX_TOKENS
    stats = got["stats"]
    assert stats["method"] == METHOD and stats["tokens"] == MAX_TOKENS
    # the stream's own stats: the API's repeat drafts as much as its adaptive gamma chooses, which follows timings
    assert got["accepted"] == stats["accepted_tokens"] > 0
    assert got["rounds"] == stats["rounds"] + 1   # the prefill's first token, then the decoding rounds
    assert page.inner_text("#f-method") == METHOD
    assert page.inner_text("#f-accepted") == str(stats["accepted_tokens"])
    assert len(page.query_selector_all("#bars .bar")) == len(stats["accepted_per_position"]) > 0
    assert float(page.inner_text("#f-speed")) > 0
    first = answer.query_selector(".round:has(.tok.acc)")
    k = len(first.query_selector_all(".tok.acc"))
    first.hover()
    page.wait_for_selector("#tip:not([hidden])")
    tip = page.inner_text("#tip")
    assert re.search(r"drafted \d+:", tip) and f"accepted {k}:" in tip, tip
    assert not page.errors, page.errors


def test_side_by_side_outputs_are_identical_at_t0_with_a_speedup(site, browser):
    """(c) autoregressive, then the chosen method: two columns with the same text at T = 0 (the API's), no drafts
    marked in the autoregressive one, and the speed-up shown once both have ended; then at T = 1.5, two samples
    that differ, said to differ."""
    page = open_page(browser, site)
    answer = ask(page, METHOD, MAX_TOKENS, side_by_side=True)
    plain, chosen = map(shown, answer.query_selector_all(".output"))
    assert plain["stats"]["method"] == "autoregressive" and chosen["stats"]["method"] == METHOD
    assert plain["text"] == chosen["text"] == chat(site, "autoregressive", MAX_TOKENS)["choices"][0]["message"]["content"]
    assert plain["accepted"] == 0 and chosen["accepted"] == chosen["stats"]["accepted_tokens"] > 0
    box = answer.query_selector("[data-role=speedup]")
    assert box.get_attribute("data-identical") == "1"
    ratio = float(box.get_attribute("data-ratio"))
    assert ratio == pytest.approx(plain["stats"]["itl_mean_s"] / chosen["stats"]["itl_mean_s"])
    assert re.search(rf"{ratio:.2f}× speed-up", box.inner_text()), box.inner_text()
    assert "one after the other so each is timed alone" in page.inner_text("aside")
    # a pair that differs (two samples at T = 1.5) is not called identical
    page.fill("#temperature", "1.5")
    page.fill("#max-tokens", "12")
    page.fill("#prompt", PROMPT)
    page.press("#prompt", "Enter")
    page.wait_for_function("() => document.querySelectorAll('#turns .answer').length === 2 && [...document"
                           ".querySelectorAll('#turns .answer:last-of-type .output')].every((o) => o.dataset.done)",
                           timeout=120_000)
    answer = page.query_selector("#turns .answer:last-of-type")
    plain, chosen = map(shown, answer.query_selector_all(".output"))
    assert plain["text"] != chosen["text"], "two samples of 12 tokens at T = 1.5 came out the same"
    box = answer.query_selector("[data-role=speedup]")
    assert box.get_attribute("data-identical") == "0" and "The outputs differ" in box.inner_text(), box.inner_text()
    assert not page.errors, page.errors


def test_the_page_asks_for_the_key_and_keeps_it_in_memory(site, browser):
    """(d) behind --api-key the page asks for the key before its first call, asks again when the server refuses
    it, then works; the key is sent as a bearer token and stored nowhere (no cookie, no web storage)."""
    context = browser.new_context()
    page = context.new_page()
    sent = []
    page.on("request", lambda r: sent.append((r.url, r.headers.get("authorization"))))
    page.goto(site + "/")
    page.wait_for_selector("#key-dialog[open]", timeout=15_000)
    assert page.inner_text("#model") == "connecting…"   # nothing loaded without the key
    page.fill("#key", "wrong")
    page.click("#key-ok")
    page.wait_for_function("() => document.querySelector('#key-note').textContent.includes('refused')")
    assert page.is_visible("#key-dialog")
    page.fill("#key", KEY)
    page.click("#key-ok")
    page.wait_for_selector("body[data-ready='1']", timeout=15_000)
    ask(page, "autoregressive", 4)
    assert page.query_selector("#turns .output").text_content() == \
        chat(site, "autoregressive", 4)["choices"][0]["message"]["content"]
    assert (site + "/v1/chat/completions", f"Bearer {KEY}") in sent
    stored = page.evaluate("() => JSON.stringify([{...localStorage}, {...sessionStorage}, document.cookie])")
    assert KEY not in stored and context.cookies() == [], stored
    context.close()
