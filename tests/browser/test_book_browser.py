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
5. screenshots of the intro, one method chapter and the search results go to
   ``book/_build/screenshots/`` for a person to look at.

The crawl runs once (module fixture); each check is its own test so that one broken page does not
hide the others. A JSON summary is written to ``book/_build/browser-report.json``.

Run: ``make book && make browser-test`` (CI: ``.ci/run``). Not part of ``make test``
(marker ``browser``). ``KVQ_CHROMIUM`` / ``KVQ_CHROMEDRIVER`` override the two binary paths,
``KVQ_BOOK_HTML`` the HTML folder (screenshots and report then go beside it).
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import json
import os
import re
import shutil
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
]
SEARCH_WORD = "quantization"          # in the intro and every method chapter
METHOD_CHAPTER = "kivi.html"          # the method chapter that is photographed
PAGE_TIMEOUT_S = 60
SEARCH_TIMEOUT_S = 30
# what a traceback or an error looks like in MyST-NB's HTML (checked against a built page)
ERROR_OUTPUT_SELECTOR = ".cell_output .output.stderr, .cell_output .output.traceback, .cell_output .output.error"
TRACEBACK_TEXT = "Traceback (most recent call last)"


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


# the browser side of a page visit: wait for every image, then read links, images and error outputs
_VISIT_JS = """
const done = arguments[arguments.length - 1];
const imgs = Array.from(document.images);
for (const img of imgs) { img.loading = "eager"; }
Promise.all(imgs.map(img => img.complete ? Promise.resolve() :
    new Promise(r => { img.addEventListener("load", r); img.addEventListener("error", r); })))
.then(() => {
  const outputs = Array.from(document.querySelectorAll(arguments[0]));
  const cells = Array.from(document.querySelectorAll(".cell_output"));
  done({
    url: location.href,
    title: document.title,
    ids: Array.from(document.querySelectorAll("[id]")).map(e => e.id),
    links: Array.from(document.querySelectorAll("a[href]")).map(a => ({
        raw: a.getAttribute("href"), href: a.href, text: (a.textContent || "").trim().slice(0, 60)})),
    images: imgs.map(img => ({src: img.currentSrc || img.src, complete: img.complete,
                              naturalWidth: img.naturalWidth})),
    errorOutputs: outputs.map(e => ({cls: e.className, text: (e.innerText || "").trim().slice(0, 400)})),
    tracebacks: cells.filter(c => (c.innerText || "").includes(arguments[1]))
                     .map(c => (c.innerText || "").trim().slice(0, 400)),
    cellOutputs: cells.length,
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
        pages[page] = driver.execute_async_script(_VISIT_JS, ERROR_OUTPUT_SELECTOR, TRACEBACK_TEXT)
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
    shots = {}
    for name, page in (("intro", "intro.html"), ("method-chapter-kivi", METHOD_CHAPTER)):
        driver.get(server + page)
        _wait_ready(driver)
        shots[name] = SHOTS / f"{name}.png"
        assert driver.save_screenshot(str(shots[name])), f"no screenshot of {page}"

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
    driver.save_screenshot(str(shots["search"]))
    _report({"search_word": SEARCH_WORD, "search_result_links": len(results), "search_result_pages": hrefs,
             "screenshots": [str(p) for p in shots.values()]})
    assert results, f"search.html?q={SEARCH_WORD} showed no result link in {SEARCH_TIMEOUT_S} s"
    for name, path in shots.items():
        assert path.is_file() and path.stat().st_size > 1000, f"screenshot {name} is missing or empty"


def test_every_requested_file_exists(crawl):
    """Runs last (file order): every file the pages, search included, asked the server for exists."""
    missing = sorted({m for m in _Handler.missing if not m.endswith("/favicon.ico")})
    _report({"missing_resources": missing})
    assert not missing, "the pages requested files the build does not have:\n" + "\n".join(missing)
