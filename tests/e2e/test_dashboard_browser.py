"""The dashboard in a real browser (issue 18): a short real run, headless Chromium (Debian's
`chromium`, which `make test` installs) driven by Playwright for Python. The page must draw its
charts and keep updating them, list the workers, show the cheating one as banned, and log no
console error. The screenshot it takes is the one in docs/operating.md (set
SWARMRL_SCREENSHOT_DIR to keep it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harness import RunHandle
from runs import EASY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_dashboard_renders_updates_and_shows_the_banned_worker(easy_base, tmp_path):
    if CHROMIUM is None:
        pytest.fail("this test needs Chromium: `make test` installs Debian's package (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    run = tmp_path / "run"
    args = ("--async.adversaries", "cherry_pick", "--validator.ban_after", "2", *EASY, "--eval.every", "2")
    with RunHandle.rl(run, easy_base, 40, *args) as launcher:
        url = launcher.wait_for_url(run / "orchestrator.json", 180)
        errors: list[str] = []
        with sync_playwright() as p:
            # --no-sandbox: CI runs as root, where Chromium's own sandbox refuses to start.
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            # bypass_csp: the page's policy forbids eval, which Playwright's wait_for_function uses;
            # the page itself runs under its policy as any visitor's would (its own code has no eval).
            page = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True).new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            points = "Number(document.querySelector('#chart-reward').dataset.points || 0)"
            page.wait_for_function(f"{points} >= 2", timeout=300_000)
            first = page.evaluate(points)
            page.wait_for_function(f"{points} > {first}", timeout=300_000)  # the charts follow the run
            page.wait_for_selector("#workers tr.banned", timeout=300_000)
            # Held-out accuracy comes from the trainer (before training, then every eval.every steps).
            page.wait_for_function(
                "Number(document.querySelector('#chart-accuracy').dataset.points || 0) >= 2", timeout=300_000
            )
            page.wait_for_function(
                "document.querySelectorAll('#workers tbody tr:not(.banned)').length >= 2", timeout=120_000
            )
            banned = page.locator("#workers tr.banned td:nth-child(3)").all_text_contents()
            assert banned == ["adversary-0-cherry_pick"], banned
            assert page.locator("#workers tr.banned .status-banned").all_text_contents() == ["banned"]
            honest = page.locator("#workers tbody tr:not(.banned) td:nth-child(3)").all_text_contents()
            assert {"worker-0", "worker-1"} <= set(honest), honest
            assert page.locator("#chart-reward polyline").count() >= 1
            assert page.locator("#versions tbody tr").count() >= 2
            assert "step" in page.text_content("#run")
            # A float32 run has no sequential test: every key's evidence cell says so.
            cells = page.locator("#workers tbody td.evidence").all_text_contents()
            assert cells and set(cells) == {"no test"}, cells
            # The cell of a calibrated run's key, drawn by the page's own code from a dashboard
            # entry: the closest test leads, as a share of its bound, and the bar is capped at full.
            drawn = page.evaluate(
                """() => {
                const c = evidenceCell([
                  {engine: "builtin", test: "mant_typ", score: 2.0, bound: 25.0, peak: 3.0, groups: 40},
                  {engine: "builtin", test: "lp_mean", score: 12.5, bound: 25.0, peak: 12.5, groups: 40}]);
                const over = evidenceCell([{engine: "vllm", test: "g", score: 30, bound: 25, peak: 30, groups: 9}]);
                return [c.querySelector(".ev-label").textContent, c.dataset.share, c.title.split("\\n").length,
                        parseFloat(over.querySelector(".ev-fill").style.width),
                        over.querySelector(".ev-fill").className];
                }"""
            )
            assert drawn == ["50% builtin/lp_mean", "0.5000", 2, 100, "ev-fill ev-over"], drawn
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("SWARMRL_SCREENSHOT_DIR"):
                shutil.copy(shot, Path(os.environ["SWARMRL_SCREENSHOT_DIR"]) / "dashboard.png")
            browser.close()
        assert errors == [], errors
