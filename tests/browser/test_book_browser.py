"""The built book, looked at in a real browser (issue 8).

Builds nothing: it takes the HTML that ``make book`` wrote to ``book/_build/html`` (and FAILS, never
skips, when it is missing), serves it on 127.0.0.1 from an ``http.server`` thread on a free port, and
drives Debian's headless Chromium (``/usr/bin/chromium``) through Selenium and Debian's
``/usr/bin/chromedriver`` (no browser or driver is downloaded: Selenium Manager is bypassed because
both paths are given) over every HTML page of the built site:

1. every ``<a href>`` to a local page or anchor resolves (the file exists; the anchor id exists in it);
2. every ``<img>`` loads, with a non-zero ``naturalWidth``;
3. no executed cell shows a traceback or error output (MyST-NB's ``div.output.stderr``,
   ``div.output.traceback``, ``div.output.error``, or "Traceback (most recent call last)");
4. the search page finds pages for a word of the book;
5. full-page screenshots (the whole document, not just the window) of the intro, one method
   chapter and the search results go to ``book/_build/screenshots/`` for a person to look at;
6. every formula is rendered, offline: the browser resolves no host name (``--host-resolver-rules``;
   the site itself is on 127.0.0.1), each page waits for ``MathJax.startup.promise``, then no visible
   text outside code shows a TeX delimiter (``\\(``, ``\\)``, ``\\[``, ``\\]``, ``$$``), every math
   element holds a rendered ``mjx-container``, MathJax reports no TeX error, no typeset text
   (``\\text{...}``) shows a backslash (``kv\\_heads`` without MathJax's textmacros), and every page
   whose Markdown source has math renders some (issue 38, item 6: a CDN MathJax showed raw TeX
   offline); display formulas wider than the text are listed in the report, not failed;
7. nothing is loaded from outside the site: every script, stylesheet, font, image and fetched
   resource of every page is on the local server (MathJax from ``_static/mathjax/``);
8. every code block and text output wraps or fits: no ``<pre>`` is wider than its box (no line
   hidden behind a horizontal scrollbar);
9. every page shows exactly one search box;
10. no bare file name (``DESIGN.md``) was turned into a link to a web host of that name.

The crawl runs once (module fixture); each check is its own test so that one broken page does not
hide the others. A JSON summary is written to ``book/_build/browser-report.json``.

Run: ``make book && make browser-test`` (CI: ``.ci/run``). Not part of ``make test``
(marker ``browser``). ``KVQ_CHROMIUM`` / ``KVQ_CHROMEDRIVER`` override the two binary paths,
``KVQ_BOOK_HTML`` the HTML folder (screenshots and report then go beside it).
"""

from __future__ import annotations

import base64
import functools
import html.parser
import http.server
import json
import os
import re
import shutil
import struct
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "book"
HTML = Path(os.environ.get("KVQ_BOOK_HTML", BOOK / "_build" / "html")).resolve()
SHOTS = HTML.parent / "screenshots"
REPORT = HTML.parent / "browser-report.json"
CHROMIUM = os.environ.get("KVQ_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("KVQ_CHROMEDRIVER", "/usr/bin/chromedriver")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run", "--window-size=1280,1000",
    # offline, as in CI: no host name resolves (a CDN script fails at once); the site is on 127.0.0.1
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]
WINDOW_WIDTH = 1280                   # the window of --window-size, kept for full-page screenshots
SEARCH_WORD = "quantization"          # in the intro and every method chapter
METHOD_CHAPTER = "kivi.html"          # the method chapter that is photographed
PAGE_TIMEOUT_S = 60
SEARCH_TIMEOUT_S = 30
# what a traceback or an error looks like in MyST-NB's HTML (checked against a built page)
ERROR_OUTPUT_SELECTOR = ".cell_output .output.stderr, .cell_output .output.traceback, .cell_output .output.error"
TRACEBACK_TEXT = "Traceback (most recent call last)"
MATHJAX_WAIT_MS = 10_000              # MathJax is local: its first typesetting takes well under a second
TEX_DELIMITERS = ("\\(", "\\)", "\\[", "\\]", "$$")
# where TeX is meant to stay raw (MathJax skips these too): code, and MathJax's own output
TEX_FREE_SKIP = "pre, code, kbd, samp, script, style, textarea, .highlight, mjx-container"
# what a person would call a search box: the theme's search field / field-like button, a search input
SEARCH_BOX_SELECTOR = 'input[type="search"], input[name="q"], .search-button-field'
MAX_SHOT_HEIGHT = 60_000              # px; a page taller than this is photographed down to here


# ------------------------------------------------------------------------------------------ the site
def _require_built_book() -> None:
    if not (HTML / "intro.html").is_file() or not (HTML / "search.html").is_file():
        pytest.fail(f"no built book in {HTML} (intro.html / search.html missing): "
                    "run `make book` first; this test builds nothing itself", pytrace=False)


def _site_pages() -> list[str]:
    """Every HTML page of the built site, relative to the HTML root ('_static' & co. are assets)."""
    pages = []
    for path in sorted(HTML.rglob("*.html")):
        rel = path.relative_to(HTML)
        if any(part.startswith("_") for part in rel.parts[:-1]):
            continue
        pages.append(rel.as_posix())
    return pages


def _toc_pages() -> list[str]:
    """The pages ``book/_toc.yml`` lists, as the HTML files they build to."""
    import yaml

    toc = yaml.safe_load((BOOK / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections"))
            for part in entry.get("parts", []) or []:
                walk(part.get("chapters"))

    walk(toc.get("chapters"))
    for part in toc.get("parts", []) or []:
        walk(part.get("chapters"))
    return [re.sub(r"\.(md|ipynb)$", "", f) + ".html" for f in files]


class _Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if key == "id" or (key == "name" and tag == "a"):
                if value:
                    self.ids.add(value)


@functools.lru_cache(maxsize=None)
def _anchor_ids(path: Path) -> frozenset[str]:
    parser = _Ids()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return frozenset(parser.ids)


class _Handler(http.server.SimpleHTTPRequestHandler):
    missing: list[str] = []

    def log_message(self, *args):  # quiet
        pass

    def send_error(self, code, *args, **kwargs):
        if code >= 400:
            _Handler.missing.append(f"{code} {self.path}")
        return super().send_error(code, *args, **kwargs)


@pytest.fixture(scope="module")
def server():
    _require_built_book()
    REPORT.unlink(missing_ok=True)
    _Handler.missing.clear()
    handler = functools.partial(_Handler, directory=str(HTML))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def driver(server):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for binary, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not Path(binary).is_file():
            pytest.fail(f"{binary} not found: install Debian's {package} "
                        "(apt-get install -y chromium chromium-driver; .ci/run does it)", pytrace=False)
    profile = tempfile.mkdtemp(prefix="kvq-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    drv.set_page_load_timeout(PAGE_TIMEOUT_S)
    drv.set_script_timeout(PAGE_TIMEOUT_S)
    try:
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


# the browser side of a page visit: wait for every image and for MathJax's first typesetting, then
# read links, images, error outputs, math, code blocks, search boxes and every resource the page used.
# arguments: error-output selector, traceback text, MathJax wait (ms), TeX-free skip selector,
# search-box selector, callback
_VISIT_JS = """
const [errorSel, tracebackText, mathWaitMs, texSkip, searchSel] = arguments;
const done = arguments[arguments.length - 1];
const imgs = Array.from(document.images);
for (const img of imgs) { img.loading = "eager"; }
const visible = el => (el.checkVisibility ? el.checkVisibility({checkOpacity: true, checkVisibilityCSS: true})
                                          : el.offsetParent !== null)
                      && el.getClientRects().length > 0;
const describe = el => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
    + (el.className && typeof el.className === "string" ? "." + el.className.trim().split(/\\s+/).join(".") : "");
// MathJax 3 defines MathJax.startup when its (deferred) script runs; its promise settles after the
// first typesetting. No MathJax after the wait: the script did not load (e.g. a CDN, offline).
const mathJaxDone = () => new Promise(resolve => {
  const end = Date.now() + mathWaitMs;
  (function poll() {
    const mj = window.MathJax;
    if (mj && mj.startup && mj.startup.promise && typeof mj.startup.promise.then === "function") {
      mj.startup.promise.then(() => resolve("typeset"), e => resolve("failed: " + e));
    } else if (!document.querySelector(".math") || Date.now() > end) {
      resolve(mj && mj.startup ? "no promise" : "not loaded");
    } else {
      setTimeout(poll, 50);
    }
  })();
});
Promise.all(imgs.map(img => img.complete ? Promise.resolve() :
    new Promise(r => { img.addEventListener("load", r); img.addEventListener("error", r); })))
.then(mathJaxDone)
.then(mathjax => {
  const outputs = Array.from(document.querySelectorAll(errorSel));
  const cells = Array.from(document.querySelectorAll(".cell_output"));
  // the text a reader sees, outside code: raw TeX here means a formula was not rendered
  const parts = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const el = n.parentElement;
    if (el && !el.closest(texSkip) && visible(el)) { parts.push(n.nodeValue); }
  }
  const maths = Array.from(document.querySelectorAll(".math"));
  const resources = [];
  for (const e of document.querySelectorAll("script[src]")) { resources.push(["script", e.src]); }
  for (const e of document.querySelectorAll("link[href]")) {
    if (/stylesheet|preload|icon|prefetch|manifest/.test(e.rel)) { resources.push(["link " + e.rel, e.href]); }
  }
  for (const e of document.querySelectorAll("img[src], iframe[src], video[src], audio[src], source[src], embed[src]")) {
    resources.push([e.tagName.toLowerCase(), e.src]);
  }
  for (const e of performance.getEntriesByType("resource")) { resources.push(["fetched " + e.initiatorType, e.name]); }
  done({
    url: location.href,
    title: document.title,
    ids: Array.from(document.querySelectorAll("[id]")).map(e => e.id),
    links: Array.from(document.querySelectorAll("a[href]")).map(a => ({
        raw: a.getAttribute("href"), href: a.href, text: (a.textContent || "").trim().slice(0, 60)})),
    images: imgs.map(img => ({src: img.currentSrc || img.src, complete: img.complete,
                              naturalWidth: img.naturalWidth})),
    errorOutputs: outputs.map(e => ({cls: e.className, text: (e.innerText || "").trim().slice(0, 400)})),
    tracebacks: cells.filter(c => (c.innerText || "").includes(tracebackText))
                     .map(c => (c.innerText || "").trim().slice(0, 400)),
    cellOutputs: cells.length,
    mathjax: mathjax,
    mathElements: maths.length,
    mathUnrendered: maths.filter(m => !m.querySelector("mjx-container"))
                         .map(m => (m.textContent || "").trim().slice(0, 120)),
    mjxContainers: document.querySelectorAll("mjx-container").length,
    // a typeset formula whose text (\\text{...}) still shows a backslash: a TeX command MathJax
    // set as text, e.g. \\_ without textmacros (read from the accessible MathML copy of the drawing)
    mathRawText: Array.from(document.querySelectorAll("mjx-container mjx-assistive-mml"))
        .map(m => Array.from(m.querySelectorAll("mtext")).map(e => e.textContent).join(" "))
        .filter(t => t.includes("\\\\")).map(t => t.slice(0, 120)),
    // display formulas wider than their box (they scroll sideways): reported, not failed
    wideDisplayMath: Array.from(document.querySelectorAll('mjx-container[display="true"]')).filter(visible)
        .filter(c => c.scrollWidth > c.clientWidth + 1)
        .map(c => ({section: (c.closest("section[id]") || {id: ""}).id,
                    scrollWidth: c.scrollWidth, clientWidth: c.clientWidth})),
    mathErrors: Array.from(document.querySelectorAll("mjx-merror"))
                     .map(e => (e.getAttribute("data-mjx-error") || e.textContent || "").slice(0, 200)),
    mathjaxScripts: Array.from(document.querySelectorAll("script[src]")).map(e => e.src)
                         .filter(src => /mathjax/i.test(src)),
    visibleText: parts.join(""),
    pres: Array.from(document.querySelectorAll("pre")).filter(visible).map(p => ({
        where: describe(p.closest("div.cell, div[class*=highlight-]") || p),
        scrollWidth: p.scrollWidth, clientWidth: p.clientWidth,
        text: (p.textContent || "").split("\\n").reduce((a, b) => b.length > a.length ? b : a, "").slice(0, 100)})),
    searchBoxes: Array.from(document.querySelectorAll(searchSel)).filter(visible).map(e => {
        const r = e.getBoundingClientRect();
        return describe(e) + " at (" + Math.round(r.left) + ", " + Math.round(r.top) + ")"; }),
    resources: resources,
  });
});
"""


def _wait_ready(drv, timeout=PAGE_TIMEOUT_S):
    end = time.monotonic() + timeout
    while drv.execute_script("return document.readyState") != "complete":
        if time.monotonic() > end:
            raise TimeoutError(f"{drv.current_url} did not finish loading in {timeout} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def crawl(server, driver):
    """Visit every page once; return what the browser saw on each."""
    pages, redirects = {}, {}
    for page in _site_pages():
        driver.get(server + page)
        _wait_ready(driver)
        if page == "index.html":  # jupyter-book's redirect to the root page: let it land
            end = time.monotonic() + 10
            while _landed(server, driver.current_url) == page and time.monotonic() < end:
                time.sleep(0.1)
            _wait_ready(driver)
        landed = _landed(server, driver.current_url)
        if landed != page:  # a redirect page: the page it lands on is checked on its own visit
            redirects[page] = landed
            continue
        pages[page] = driver.execute_async_script(_VISIT_JS, ERROR_OUTPUT_SELECTOR, TRACEBACK_TEXT,
                                                  MATHJAX_WAIT_MS, TEX_FREE_SKIP, SEARCH_BOX_SELECTOR)
    return {"pages": pages, "redirects": redirects}


def _landed(server: str, url: str) -> str:
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path).lstrip("/")
    return url if not url.startswith(server) else (path or "index.html")


def _local_target(server: str, href: str):
    """(file, fragment) for an href on the local server, or None for anything else."""
    if not href.startswith(server):
        return None
    parts = urllib.parse.urlsplit(href)
    path = urllib.parse.unquote(parts.path).lstrip("/")
    if path == "" or path.endswith("/"):
        path += "index.html"
    return HTML / path, urllib.parse.unquote(parts.fragment)


def _report(results: dict) -> None:
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(REPORT.read_text()) if REPORT.is_file() else {}
    old.update(results)
    REPORT.write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")


def _full_page_screenshot(drv, path: Path) -> dict:
    """Photograph the whole page, not just the window, into ``path`` (PNG); return the sizes.

    The viewport is made as tall as the document (CDP ``Emulation.setDeviceMetricsOverride``, at
    most ``MAX_SHOT_HEIGHT`` px) and the capture goes beyond the viewport (``Page.captureScreenshot``
    with ``captureBeyondViewport``); the override is cleared afterwards. Returns ``{"page_height":
    the document's height in the tall viewport, "png_width", "png_height"}`` for the caller to check.
    """
    height_js = ("return Math.max(document.documentElement.scrollHeight, "
                 "document.body ? document.body.scrollHeight : 0)")
    height = min(int(drv.execute_script(height_js)), MAX_SHOT_HEIGHT)
    try:
        for _ in range(3):  # a taller viewport can change the layout (100vh boxes): measure again
            drv.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
                "width": WINDOW_WIDTH, "height": height, "deviceScaleFactor": 1, "mobile": False})
            new_height = min(int(drv.execute_script(height_js)), MAX_SHOT_HEIGHT)
            if new_height == height:
                break
            height = new_height
        shot = drv.execute_cdp_cmd("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True, "fromSurface": True,
            "clip": {"x": 0, "y": 0, "width": WINDOW_WIDTH, "height": height, "scale": 1}})
    finally:
        drv.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    data = base64.b64decode(shot["data"])
    path.write_bytes(data)
    png_width, png_height = _png_size(data)
    return {"page_height": height, "png_width": png_width, "png_height": png_height}


def _png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError(f"data: expected a PNG file, got {data[:16]!r}")
    return struct.unpack(">II", data[16:24])


_FENCE_OPEN = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*(.*)$")
_INLINE_CODE = re.compile(r"(`+)(?!`)[^\n]+?(?<!`)\1")
_SOURCE_MATH = re.compile(r"\$\$|\$[^\s$][^$\n]*\$|\{math\}|\\begin\{")


def _prose(md_text: str) -> str:
    """A MyST page without its code: code fences (plain, language, {code-cell}, {code-block}, ...)
    and inline code removed; a directive fence ({admonition}, {note}, ...) keeps its content."""
    kept, closing = [], None
    for line in md_text.splitlines():
        if closing is not None:  # inside a code fence: drop until its closing fence
            if re.match(rf"^[ \t]*{re.escape(closing)}{re.escape(closing[0])}*[ \t]*$", line):
                closing = None
            continue
        opening = _FENCE_OPEN.match(line)
        if opening and (not opening.group(2).startswith("{") or opening.group(2).startswith("{code")):
            closing = opening.group(1)
            continue
        kept.append(line)
    return _INLINE_CODE.sub("", "\n".join(kept))


def _source_has_math(md_text: str) -> bool:
    """Whether a MyST page's source writes math ($...$, $$...$$, {math}, \\begin{...}) outside code."""
    return bool(_SOURCE_MATH.search(_prose(md_text)))


def _tex_delimiters_in(text: str) -> list[str]:
    """Each TeX delimiter in ``text`` with a little context either side, for the failure message."""
    found = []
    for delim in TEX_DELIMITERS:
        start = text.find(delim)
        while start != -1:
            found.append(f"{delim!r} in ...{text[max(0, start - 40):start + 60]!r}...")
            start = text.find(delim, start + len(delim))
    return found


# --------------------------------------------------------------------------------------------- tests
def test_built_site_has_every_toc_page():
    _require_built_book()
    pages = set(_site_pages())
    missing = [p for p in _toc_pages() if p not in pages]
    assert not missing, (f"pages in book/_toc.yml with no HTML in {HTML}: {missing} "
                         "(a stale or failed build: run `make book`)")


def test_every_page_loads(crawl):
    pages, redirects = crawl["pages"], crawl["redirects"]
    _report({"pages_visited": sorted(pages), "redirects": redirects})
    assert set(pages) | set(redirects) == set(_site_pages())
    bad = {src: dst for src, dst in redirects.items() if dst not in pages}
    assert not bad, f"redirect pages that land outside the built site: {bad}"
    untitled = [page for page, seen in pages.items() if not seen["title"].strip()]
    assert not untitled, f"pages with an empty <title> (did they render?): {untitled}"


def test_no_broken_internal_links(server, crawl):
    broken, checked, targets = [], 0, set()
    for page, seen in crawl["pages"].items():
        for link in seen["links"]:
            target = _local_target(server, link["href"])
            if target is None:  # external (http to elsewhere), mailto:, javascript:, ...
                continue
            file, fragment = target
            checked += 1
            targets.add((file, fragment))
            if not file.is_file():
                broken.append(f"{page}: href={link['raw']!r} ({link['text']!r}): no file {file.relative_to(HTML)}")
                continue
            if not fragment or file.suffix != ".html":
                continue
            same_page = urllib.parse.urlsplit(link["href"])._replace(fragment="").geturl() == \
                urllib.parse.urlsplit(seen["url"])._replace(fragment="").geturl()
            ids = set(_anchor_ids(file)) | (set(seen["ids"]) if same_page else set())
            if fragment not in ids:
                broken.append(f"{page}: href={link['raw']!r} ({link['text']!r}): "
                              f"no id {fragment!r} in {file.relative_to(HTML)}")
    _report({"internal_links_checked": checked, "internal_link_targets": len(targets),
             "broken_links": broken})
    assert checked > 0, "no internal link found at all: did the pages render?"
    assert not broken, f"{len(broken)} broken internal link(s) of {checked}:\n" + "\n".join(broken)


def test_every_image_loads(crawl):
    bad, count = [], 0
    for page, seen in crawl["pages"].items():
        for img in seen["images"]:
            count += 1
            if not img["complete"] or img["naturalWidth"] == 0:
                bad.append(f"{page}: {img['src']} (complete={img['complete']}, naturalWidth={img['naturalWidth']})")
    _report({"images_checked": count, "broken_images": bad})
    assert count > 0, "no <img> on any page: the book's figures are missing"
    assert not bad, f"{len(bad)} image(s) of {count} did not load:\n" + "\n".join(bad)


def test_no_error_output_in_executed_cells(crawl):
    found, outputs = [], 0
    for page, seen in crawl["pages"].items():
        outputs += seen["cellOutputs"]
        for out in seen["errorOutputs"]:
            found.append(f"{page}: <div class=\"{out['cls']}\">: {out['text']}")
        for text in seen["tracebacks"]:
            found.append(f"{page}: traceback in a cell output: {text}")
    _report({"cell_outputs_checked": outputs, "error_outputs": found})
    assert not found, (f"{len(found)} cell output(s) with stderr / a traceback / an error "
                       f"(of {outputs} cell outputs):\n" + "\n\n".join(found))


def test_search_finds_results_and_screenshots(server, driver):
    from selenium.webdriver.common.by import By

    SHOTS.mkdir(parents=True, exist_ok=True)
    shots, sizes = {}, {}
    for name, page in (("intro", "intro.html"), ("method-chapter-kivi", METHOD_CHAPTER)):
        driver.get(server + page)
        _wait_ready(driver)
        driver.execute_async_script(  # photograph the formulas typeset, not raw TeX
            "const done = arguments[arguments.length - 1];"
            "const p = window.MathJax && MathJax.startup && MathJax.startup.promise;"
            "p && p.then ? p.then(() => done(true), () => done(false)) : done(false);")
        shots[name] = SHOTS / f"{name}.png"
        sizes[name] = _full_page_screenshot(driver, shots[name])

    driver.get(server + "search.html?q=" + urllib.parse.quote(SEARCH_WORD))
    _wait_ready(driver)
    results = []
    end = time.monotonic() + SEARCH_TIMEOUT_S
    while time.monotonic() < end:
        results = driver.find_elements(By.CSS_SELECTOR, "#search-results ul.search li a[href]")
        status = driver.execute_script(
            "const p = document.querySelector('#search-results .search-summary');"
            "return p ? p.textContent : '';")
        if results and status:  # the summary appears when the search has finished
            break
        time.sleep(0.2)
    hrefs = sorted({urllib.parse.urlsplit(a.get_attribute("href")).path.lstrip("/") for a in results})
    shots["search"] = SHOTS / "search-results.png"
    sizes["search"] = _full_page_screenshot(driver, shots["search"])
    _report({"search_word": SEARCH_WORD, "search_result_links": len(results), "search_result_pages": hrefs,
             "screenshots": [str(p) for p in shots.values()], "screenshot_sizes": sizes})
    assert results, f"search.html?q={SEARCH_WORD} showed no result link in {SEARCH_TIMEOUT_S} s"
    for name, path in shots.items():
        assert path.is_file() and path.stat().st_size > 1000, f"screenshot {name} is missing or empty"
    # full page: the picture is as tall as the document (the window is 1000 px; the chapters are longer)
    for name, size in sizes.items():
        assert size["png_width"] == WINDOW_WIDTH and size["png_height"] >= size["page_height"], \
            f"screenshot {name} is {size['png_width']}x{size['png_height']} px, the page {size['page_height']} px tall"
    for name in ("intro", "method-chapter-kivi"):
        assert sizes[name]["png_height"] > 1000, \
            f"screenshot {name} is {sizes[name]['png_height']} px tall: only the window, not the whole page?"


def test_math_renders_offline(crawl):
    """Every formula is typeset by a MathJax that loaded with no network: no raw TeX is left."""
    problems, math_pages, containers, wide_display = [], [], 0, []
    pages = crawl["pages"]
    for page, seen in pages.items():
        containers += seen["mjxContainers"]
        if seen["mathElements"]:
            math_pages.append(page)
            if seen["mathjax"] != "typeset":
                problems.append(f"{page}: MathJax {seen['mathjax']} (scripts: {seen['mathjaxScripts']})")
        for tex in seen["mathUnrendered"]:
            problems.append(f"{page}: a math element with no mjx-container: {tex!r}")
        for err in seen["mathErrors"]:
            problems.append(f"{page}: MathJax TeX error: {err!r}")
        for text in seen["mathRawText"]:
            problems.append(f"{page}: a typeset formula shows a TeX command as text: {text!r}")
        wide_display += [f"{page}#{d['section']}: {d['scrollWidth']} px in {d['clientWidth']} px"
                         for d in seen["wideDisplayMath"]]
        for hit in _tex_delimiters_in(seen["visibleText"]):
            problems.append(f"{page}: raw TeX on screen: {hit}")
    # independent of the HTML: a page whose Markdown writes math must show typeset math
    source_math = []
    for html_page in _toc_pages():
        md = BOOK / html_page.replace(".html", ".md")
        if md.is_file() and _source_has_math(md.read_text(encoding="utf-8")):
            source_math.append(html_page)
            if html_page in pages and pages[html_page]["mjxContainers"] == 0:
                problems.append(f"{html_page}: its source {md.name} has math, the page has no mjx-container")
    _report({"math_pages": sorted(math_pages), "math_pages_by_source": source_math,
             "mjx_containers": containers, "math_problems": problems,
             # MathJax 3 cannot break a display formula: one wider than the text scrolls in its box.
             # Reported for the page's author (shorter, or split with aligned), not failed.
             "display_math_wider_than_text": wide_display})
    assert source_math and math_pages, "no page with math found: did the math detection break?"
    assert not problems, f"{len(problems)} math problem(s):\n" + "\n".join(problems)


def test_nothing_loaded_from_outside_the_site(server, crawl):
    """Scripts, styles, fonts, images: all from the built site (MathJax from _static/mathjax/)."""
    outside, mathjax = [], set()
    for page, seen in crawl["pages"].items():
        for kind, url in seen["resources"]:
            if not url.startswith((server, "data:", "blob:", "about:")):
                outside.append(f"{page}: {kind} {url}")
        for src in seen["mathjaxScripts"]:
            mathjax.add(src.replace(server, ""))
            if not src.startswith(server + "_static/"):
                outside.append(f"{page}: MathJax from {src}, not from the site's _static/")
    _report({"outside_resources": outside, "mathjax_scripts": sorted(mathjax)})
    assert mathjax, "no page loads MathJax at all"
    assert not outside, f"{len(outside)} resource(s) from outside the built site:\n" + "\n".join(outside)


def test_code_blocks_wrap_or_fit(crawl):
    """No code block or text output hides part of a line behind a horizontal scrollbar."""
    wide, count = [], 0
    for page, seen in crawl["pages"].items():
        for pre in seen["pres"]:
            count += 1
            if pre["scrollWidth"] > pre["clientWidth"] + 1:
                wide.append(f"{page}: {pre['where']}: {pre['scrollWidth']} px of text in "
                            f"{pre['clientWidth']} px: {pre['text']!r}")
    _report({"code_blocks_checked": count, "code_blocks_too_wide": wide})
    assert count > 0, "no <pre> on any page: did the code cells render?"
    assert not wide, f"{len(wide)} code block(s) of {count} wider than their box:\n" + "\n".join(wide)


def test_one_search_box_per_page(crawl):
    boxes = {page: seen["searchBoxes"] for page, seen in crawl["pages"].items()}
    bad = {page: found for page, found in boxes.items() if len(found) != 1}
    _report({"search_boxes": boxes})
    assert not bad, "pages without exactly one visible search box:\n" + "\n".join(
        f"{page}: {len(found)}: {found}" for page, found in sorted(bad.items()))


def test_no_file_name_linked_as_a_web_host(crawl):
    """MyST's linkify must not turn a bare file name (DESIGN.md: .md is a top-level domain) into a link."""
    bad = []
    for page, seen in crawl["pages"].items():
        for link in seen["links"]:
            parts = urllib.parse.urlsplit(link["href"])
            if parts.scheme in ("http", "https") and parts.path in ("", "/") and \
                    re.fullmatch(r"[\w.-]+\.(md|py|json|txt|yml|yaml|toml|cu|sh|csv|ipynb)", parts.netloc, re.I):
                bad.append(f"{page}: {link['raw']!r} ({link['text']!r})")
    _report({"file_names_linked_as_hosts": bad})
    assert not bad, "file names turned into web links:\n" + "\n".join(bad)


def test_every_requested_file_exists(crawl):
    """Runs last (file order): every file the pages, search included, asked the server for exists."""
    missing = sorted({m for m in _Handler.missing if not m.endswith("/favicon.ico")})
    _report({"missing_resources": missing})
    assert not missing, "the pages requested files the build does not have:\n" + "\n".join(missing)
