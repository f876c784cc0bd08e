"""Screenshots of `specrt serve`'s playground (GET /) for the docs: one mid-stream with a round's tooltip open, one
after a side-by-side run (autoregressive, then the chosen method, and the speed-up).

    python -m specrt.measurement.playground_shots engines/default --out docs/images

A real server of ENGINES on a free port, the page in a headless Chromium driven by Playwright (the system's Chromium:
`apt-get install chromium`; Playwright's own browser download is not used)."""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from specrt.errors import InputError
from specrt.measurement.serve_bench import server

STREAM_PROMPT = "Write a short story about a lighthouse keeper."
PAIR_PROMPT = "Write a short poem about the sea."
VIEWPORT = {"width": 1280, "height": 800}


def chromium_path(given: str | None) -> str:
    path = given or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise InputError("no Chromium found: install the system's (`apt-get install chromium`) or give --chromium PATH")
    return path


def ask(page, prompt: str, method: str, max_tokens: int, side_by_side: bool) -> None:
    page.select_option("#method", method)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(max_tokens))
    page.set_checked("#side-by-side", side_by_side)
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")


def stream_shot(page, path: Path, method: str, tokens_shown: int, max_tokens: int) -> bool:
    """The page while an answer streams, the tooltip of its latest round with accepted drafts open; whether the
    answer was still streaming when the shot was taken."""
    ask(page, STREAM_PROMPT, method, max_tokens, side_by_side=False)
    page.wait_for_function(f"() => document.querySelectorAll('#turns .tok').length >= {tokens_shown} || "
                           "document.querySelector('#turns .output[data-done]')", timeout=300_000)
    # the latest round with the most accepted drafts in the left half of the text (its tooltip stays over the text),
    # found in one call: the stream goes on meanwhile
    index = page.evaluate("""() => {
        let best = null, most = 0;
        for (const r of document.querySelectorAll('#turns .round')) {
          const n = r.querySelectorAll('.tok.acc').length;
          if (n && n >= most && r.getBoundingClientRect().left < 480) { best = r.dataset.round; most = n; }
        }
        return best; }""")
    if index is not None:
        page.hover(f"#turns .round[data-round='{index}']")
        page.wait_for_selector("#tip:not([hidden])")
    streaming = page.query_selector("#turns .output[data-done]") is None
    page.screenshot(path=str(path))
    page.wait_for_selector("#turns .output[data-done]", timeout=300_000)
    page.mouse.move(0, 0)
    return streaming


def side_by_side_shot(page, path: Path, method: str, max_tokens: int) -> str:
    """The page once a side-by-side run has ended; the speed-up's line."""
    page.click("#reset")
    ask(page, PAIR_PROMPT, method, max_tokens, side_by_side=True)
    page.wait_for_selector("#turns [data-role=speedup]", timeout=300_000)
    time.sleep(0.3)   # the last scroll
    page.screenshot(path=str(path))
    return page.inner_text("#turns [data-role=speedup]")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Screenshots of specrt serve's playground page, mid-stream and after a "
                                 "side-by-side run, for the docs.")
    ap.add_argument("engines", type=Path, help="the engine set to serve (e.g. engines/default)")
    ap.add_argument("--out", type=Path, default=Path("docs/images"), help="the folder of the PNG files")
    ap.add_argument("--method", default="eagle", help="the method shown (default: eagle)")
    ap.add_argument("--chromium", default=None, help="the Chromium binary (default: chromium on PATH)")
    ap.add_argument("--stream-tokens", type=int, default=90, help="tokens shown when the mid-stream shot is taken")
    ap.add_argument("--pair-tokens", type=int, default=96, help="max tokens of the side-by-side run")
    args = ap.parse_args(argv)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise SystemExit("playwright is missing: pip install -e '.[test]'") from None
    browser_path = chromium_path(args.chromium)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, server(args.engines, Path(tmp) / "server.log") as (url, _), \
            sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path)
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(url + "/")
        page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        methods = page.eval_on_selector_all("#method option", "(os) => os.map((o) => o.value)")
        if args.method not in methods:
            raise SystemExit(f"method {args.method!r}: {args.engines} serves {', '.join(methods)}")
        shot = args.out / "playground-stream.png"
        streaming = stream_shot(page, shot, args.method, args.stream_tokens, 4 * args.stream_tokens)
        print(f"{shot}: {'mid-stream' if streaming else 'the stream had ended before the shot'}")
        shot = args.out / "playground-side-by-side.png"
        print(f"{shot}: {side_by_side_shot(page, shot, args.method, args.pair_tokens)}")
        browser.close()


if __name__ == "__main__":
    main()
