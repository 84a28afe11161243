"""A screenshot of a server's dashboard in headless Chromium, taken while requests run:
what `metal-serve bench serve --dashboard-screenshot` saves (docs/dashboard.png is one).

Playwright drives the system's Chromium (or Chrome); it downloads no browser of its own.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

# Debian's package, other distributions' names, then Chrome on a Mac.
_BROWSERS = ("chromium", "chromium-browser", "google-chrome",
             "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome")  # fmt: skip
_RUNNING_ROW = "#requests tbody tr[data-status=running]"


def find_chromium() -> str | None:
    """The path of a Chromium-family browser on this machine, if there is one."""
    for name in _BROWSERS:
        found = shutil.which(name) or (name if Path(name).is_file() else None)
        if found:
            return found
    return None


class DashboardScreenshot(threading.Thread):
    """Saves `base_url`/dashboard as a PNG at `path`: `delay_s` after `start()`, once the page
    shows at least `min_running` running requests. `stop()` gives up waiting (the run it
    watches is over); `join()`, then `error` says why no screenshot was taken, if none was."""

    def __init__(self, base_url: str, path: Path, delay_s: float = 10.0,
                 min_running: int = 1, width: int = 1280) -> None:
        super().__init__(name="dashboard-screenshot", daemon=True)
        self.url = f"{base_url.rstrip('/')}/dashboard?refresh=1"
        self.path, self.delay_s, self.min_running, self.width = path, delay_s, min_running, width
        self.error: str | None = None
        self._stopped = threading.Event()
        self.browser = find_chromium()

    def check(self) -> None:
        """Raise a RuntimeError naming what to install, before a run starts."""
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            raise RuntimeError("--dashboard-screenshot needs Playwright: pip install playwright "
                               "(it is in metal-serve's dev extra)") from None
        if self.browser is None:
            raise RuntimeError("--dashboard-screenshot needs Chromium: apt-get install chromium "
                               "(or install Google Chrome)")

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        try:
            self._take()
        except Exception as exc:  # reported by the caller after the run
            self.error = f"the dashboard screenshot failed: {exc}"

    def _take(self) -> None:
        from playwright.sync_api import sync_playwright

        started = time.monotonic()
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=self.browser)
            try:
                page = browser.new_page(viewport={"width": self.width, "height": 900})
                page.goto(self.url)
                if not self._wait(page, started):
                    self.error = (f"the run ended before {self.delay_s:g}s had passed with "
                                  f"{self.min_running} running request(s) on the dashboard; "
                                  "lower --dashboard-screenshot-delay or run longer")
                    return
                self.path.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(self.path), full_page=True)
            finally:
                browser.close()

    def _wait(self, page, started: float) -> bool:
        """Whether the moment came before `stop()`."""
        while not self._stopped.is_set():
            waited = time.monotonic() - started >= self.delay_s
            if waited and page.locator(_RUNNING_ROW).count() >= self.min_running:
                return True
            page.wait_for_timeout(200)
        return False
