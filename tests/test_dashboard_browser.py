"""The dashboard in headless Chromium (the system's, driven by Playwright) against a real
server over the tiny model: it loads with no console errors, shows a request while it
streams, shows /metrics' numbers within one refresh, asks for the API key and keeps it out
of every URL. (`bench serve --dashboard-screenshot` is tested in test_bench.py.)"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest
from dashboard_helpers import (
    complete,
    metrics_view,
    scrape,
    streaming_completion,
    tiny_dashboard_server,
)

from server.dashboard.screenshot import find_chromium

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install chromium")
REFRESH_S = 0.2
# The page's numbers: fractions are shown as percentages with one decimal.
PERCENT_FIELDS = {"kv_cache.usage"}


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with tiny_dashboard_server(tmp_path_factory.mktemp("tiny")) as base:
        yield base


@contextlib.contextmanager
def dashboard(browser, base_url: str) -> Iterator[tuple[object, list[str]]]:
    """The page, and the console errors and uncaught exceptions it has had so far."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
    page.goto(f"{base_url}/dashboard?refresh={REFRESH_S}")
    try:
        yield page, problems
    finally:
        page.close()


def refreshes(page) -> int:
    return int(page.locator("body").get_attribute("data-refreshes"))


def wait_for_refreshes(page, count: int) -> None:
    # A function, not an expression: the page's policy forbids evaluating strings.
    page.wait_for_function("(count) => Number(document.body.dataset.refreshes) >= count",
                           arg=count, timeout=10_000)


def shown(page, path: str) -> float:
    """A number as the page shows it ("1,234", "12.5%"), as /metrics states it."""
    text = page.locator(f'[data-field="{path}"]').first.inner_text()
    value = float(re.sub(r"[,%]", "", text))
    return value / 100 if path in PERCENT_FIELDS else value


def test_page_loads_without_console_errors(browser, url):
    complete(url)  # something in the charts and totals
    with dashboard(browser, url) as (page, problems):
        wait_for_refreshes(page, 3)
        assert page.locator("#main").is_visible() and not page.locator("#key-form").is_visible()
        assert page.locator("#connection").inner_text().startswith("live")
        assert page.locator('[data-field="model.served_name"]').inner_text() == "tiny"
        assert page.locator("#chart-throughput line").count() >= 2  # drawn, if still empty
        assert not page.locator('[data-section="speculative"]').is_visible()
        assert page.locator("#no-requests").is_visible()
        assert problems == []


def test_page_shows_a_running_request_while_it_streams(browser, url):
    with dashboard(browser, url) as (page, problems):
        with streaming_completion(url) as request_id:
            row = page.locator(f'#requests tr[data-request-id="{request_id}"]')
            row.wait_for(timeout=10_000)
            cells = row.locator("td").all_inner_texts()
            assert cells[:3] == [request_id, "completions", "running"]
            assert cells[5] == "40" and int(cells[8].replace(",", "")) > 0  # prompt, generated
            assert shown(page, "requests.running") >= 1
        row.wait_for(state="detached", timeout=10_000)  # closed: aborted, and gone
        assert page.locator("#no-requests").is_visible()
        assert problems == []


def test_page_numbers_match_metrics_within_one_refresh(browser, url):
    with dashboard(browser, url) as (page, problems):
        with streaming_completion(url):  # the counters move while the page reads them
            for _ in range(3):
                before = metrics_view(scrape(url))
                wait_for_refreshes(page, refreshes(page) + 2)  # one whose poll began after it
                on_page = {path: shown(page, path) for path in before}
                after = metrics_view(scrape(url))
                for path, value in on_page.items():
                    slack = 0.0005 if path in PERCENT_FIELDS else 0  # one decimal of a percent
                    assert before[path] - slack <= value <= after[path] + slack, path
        complete(url)
        idle = metrics_view(scrape(url))
        wait_for_refreshes(page, refreshes(page) + 2)
        for path, value in idle.items():
            assert shown(page, path) == pytest.approx(value, abs=0.0005), path
        assert problems == []


def test_page_asks_for_the_key_and_keeps_it_out_of_urls(browser, tmp_path):
    with tiny_dashboard_server(tmp_path, api_keys=("secret-key",)) as base:
        with dashboard(browser, base) as (page, problems):
            urls, keys_sent = [], []
            page.on("request", lambda r: (urls.append(r.url),
                                          keys_sent.append(r.headers.get("authorization"))))
            form = page.locator("#key-form")
            form.wait_for()
            assert not page.locator("#main").is_visible() and problems == []
            page.fill("#key-input", "wrong")
            page.click("#key-form button")
            page.locator("#key-error").wait_for()
            assert "refused" in page.locator("#key-error").inner_text()
            page.fill("#key-input", "secret-key")
            page.click("#key-form button")
            wait_for_refreshes(page, 2)
            assert page.locator("#main").is_visible() and not form.is_visible()
            page.reload()  # the key stays for this tab
            wait_for_refreshes(page, 1)
            assert page.locator("#main").is_visible()
        assert not any("secret" in u or "wrong" in u for u in urls) and page.url.endswith(
            f"/dashboard?refresh={REFRESH_S}")
        assert "Bearer secret-key" in keys_sent
        # The one refused poll is the only error (Chromium logs every 401 it gets).
        assert [p for p in problems if "401" not in p] == [] and len(problems) == 1
