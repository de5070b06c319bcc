"""A headless Chromium page driven by Playwright, for the dashboard's tests.

Chromium is Debian's (``apt-get install chromium``, in README's test command): Playwright's own
browser download cannot reach its servers here. The flags keep Chromium off the network it would
otherwise try at start (updates, sync), which this machine refuses.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

from playwright.sync_api import Page, sync_playwright

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 1000) -> Iterator[Page]:
    """A fresh page; browser errors logged by the page fail the test that used it."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError("the dashboard's tests need Chromium: apt-get install chromium")
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("pageerror", lambda error: errors.append(str(error)))
            yield page
        finally:
            browser.close()
    assert not errors, f"the page raised: {errors}"
