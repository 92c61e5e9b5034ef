"""Drive the live dashboard in Debian's headless Chromium through Playwright (no browser download)."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, sync_playwright

ARTIFACTS = Path(os.environ.get("TITAN_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))
# A generous ceiling for each wait; every wait ends as soon as its event happens.
WAIT_MS = 300_000


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no system Chromium: `apt-get install chromium` (.ci/run installs it)")


@contextmanager
def dashboard_page(url: str, api_key: str | None = None) -> Iterator[tuple[Page, list[str]]]:
    """The page at `url` with every console error and uncaught exception collected; `api_key` is put where
    the page's key form would store it."""
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.on("console", lambda message: problems.append(f"console {message.type}: {message.text}")
                    if message.type == "error" else None)
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            if api_key is not None:
                page.add_init_script(f"sessionStorage.setItem('titanKey', {json.dumps(api_key)})")
            page.goto(url)
            yield page, problems
        finally:
            browser.close()


def wait_polls(page: Page, count: int) -> None:
    page.wait_for_function(f"window.titanDashboard && window.titanDashboard.polls >= {count}", timeout=WAIT_MS)


def polls(page: Page) -> int:
    return int(page.evaluate("window.titanDashboard.polls"))


def series(page: Page, panel_title: str, name: str) -> list[Any]:
    """Every point the page has drawn for one series of one panel."""
    return list(page.evaluate(
        """([title, name]) => {
            const view = window.titanDashboard.panels.find((v) => v.panel.title === title);
            return view.data[view.panel.series.indexOf(name) + 1];
        }""", [panel_title, name]))


def load_until(condition: Callable[[], bool], send: Callable[[int], None], max_requests: int) -> int:
    """Send requests one after another (in a thread) until `condition` holds or `max_requests` went out;
    the number sent."""
    done = threading.Event()
    sent = [0]

    def run() -> None:
        while not done.is_set() and sent[0] < max_requests:
            send(sent[0])
            sent[0] += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        while thread.is_alive() and not condition():
            thread.join(0.2)  # a check interval, not a deadline: the loop ends on the condition or the count
        condition_held = condition()
    finally:
        done.set()
        thread.join()
    assert condition_held, f"the dashboard never showed the load after {sent[0]} requests"
    return sent[0]


def screenshot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path
