"""A real browser: JupyterLab serves the tour, headless Chromium runs every cell, and the page
shows plotly timelines with bars and a live explorer widget (changing its strategy redraws
its figure), with no widget or kernel error.

It drives Debian's ``chromium`` (``apt-get install chromium``; ``.ci/run`` installs it) through
Playwright for Python, never a downloaded browser. Without chromium or Playwright the test
fails under CI (``CI=true``) and is skipped elsewhere, with the reason. It leaves a screenshot
of the explorer at ``out/browser-tour.png`` (and ``out/browser-tour-timeline.png``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ModuleNotFoundError:  # reported by the test itself
    PlaywrightTimeout = TimeoutError

ROOT = Path(__file__).resolve().parents[1]
TOUR = ROOT / "notebooks" / "01-tour.ipynb"
SHOTS = ROOT / "out"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
# JupyterLab settings for the test: every cell stays in the page (no virtual scrolling), and
# nothing reaches for the network (news, update checks).
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False},
}
SERVER_START_S = 90
RUN_ALL_S = 240


def unavailable(reason: str):
    """Fail under CI (the browser must be there), skip elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


def chromium() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium"
                                         if os.access("/usr/bin/chromium", os.X_OK) else None)
    if found is None:
        unavailable("Debian's chromium is not installed (apt-get install chromium; .ci/run "
                    "installs it)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on localhost with a token, serving a copy of the tour (the run must not
    autosave outputs into the committed notebook). Yields the notebook's URL and the server's
    log file. The kernel runs the tour on the cpu datapath."""
    for module in ("jupyterlab", "ipywidgets", "anywidget", "plotly"):
        try:
            __import__(module)
        except ModuleNotFoundError:
            unavailable(f"{module} is not installed (pip install -e '.[test]')")
    home = tmp_path_factory.mktemp("lab")
    root = home / "root"
    root.mkdir()
    shutil.copy(TOUR, root / TOUR.name)
    settings = home / "settings"
    for rel, value in SETTINGS.items():
        path = settings / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
           "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(home / "jupyterlab.log", "w")  # noqa: SIM115
    server = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited with {server.returncode}:\n"
                            + (home / "jupyterlab.log").read_text()[-3000:], pytrace=False)
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer within {SERVER_START_S} s:\n"
                                + (home / "jupyterlab.log").read_text()[-3000:], pytrace=False)
                time.sleep(0.5)
        yield f"{base}/lab/tree/{TOUR.name}?token={token}", home / "jupyterlab.log"
    finally:
        _stop(server)
        log.close()


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the server and the kernels it started)."""
    if server.poll() is None:
        try:
            os.killpg(server.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


def _prompts(page) -> list[str]:
    return page.eval_on_selector_all(".jp-CodeCell .jp-InputPrompt",
                                     "els => els.map(e => e.textContent.trim())")


def _bars(area) -> int:
    """Bars plotly drew inside ``area`` (which may itself be the plot)."""
    return area.locator(".barlayer .point").count()


@pytest.fixture(scope="module")
def executable() -> str:
    """Chromium's path, once Playwright for Python is known to be there (checked before
    JupyterLab starts)."""
    path = chromium()
    try:
        import playwright.sync_api  # noqa: F401
    except ModuleNotFoundError:
        unavailable("Playwright for Python is not installed (pip install -e '.[test]')")
    return path


def test_tour_runs_in_jupyterlab_with_timelines_and_a_live_explorer(executable, lab):
    from playwright.sync_api import sync_playwright

    url, server_log = lab
    SHOTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True,
                                     args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            problems: list[str] = []
            page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
            page.goto(url, wait_until="domcontentloaded", timeout=60_000)
            page.wait_for_selector(".jp-Notebook .jp-CodeCell", timeout=60_000)
            cells = sum(c["cell_type"] == "code" for c in json.loads(TOUR.read_text())["cells"])
            page.wait_for_function(f"() => document.querySelectorAll("
                                   f"'.jp-Notebook .jp-CodeCell').length === {cells}",
                                   timeout=60_000)  # cells render in batches
            # the kernel is ready when the status bar says "Python 3 (ipykernel) | Idle"
            page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\|\s*Idle")).first \
                .wait_for(timeout=90_000)
            _run_all(page)
            _wait_all_run(page, cells, server_log)

            text = page.locator(".jp-NotebookPanel").inner_text()
            assert "Traceback (most recent call last)" not in text, _around(text, "Traceback")
            assert "Error displaying widget" not in text
            assert not page.locator(".jp-Dialog").count(), page.locator(".jp-Dialog").inner_text()

            # the tour's static timelines: plotly's JupyterLab renderer draws into the output
            timelines = page.locator(".jp-OutputArea-output.jp-RenderedPlotly")
            assert timelines.count() >= 2, "the tour's timeline figures did not render"
            timelines.nth(1).scroll_into_view_if_needed()  # the measured one
            assert _bars(timelines.nth(0)) > 0 and _bars(timelines.nth(1)) > 0
            page.screenshot(path=str(SHOTS / "browser-tour-timeline.png"))

            explorer = page.locator(".jp-OutputArea-output", has=page.locator(".widget-dropdown"))
            assert explorer.count() == 1, "the explorer widget did not render"
            explorer.scroll_into_view_if_needed()
            page.wait_for_function(
                "el => el.querySelectorAll('.js-plotly-plot .barlayer .point').length > 0",
                arg=explorer.element_handle(), timeout=60_000)
            strategy = explorer.locator(".widget-dropdown", has_text="strategy").locator("select")
            assert strategy.input_value() == "direct-push"
            before = _bars(explorer), _title(explorer)
            strategy.select_option("ring")
            deadline = time.monotonic() + 60
            while (_bars(explorer), _title(explorer)) == before:
                assert time.monotonic() < deadline, \
                    f"the explorer's figure did not change after choosing ring: {before}"
                page.wait_for_timeout(250)
            page.wait_for_timeout(500)  # let plotly finish drawing before the picture
            after = _bars(explorer), _title(explorer)
            assert after[0] > 0 and "ring" in after[1], after
            assert "Error displaying widget" not in explorer.inner_text()
            page.screenshot(path=str(SHOTS / "browser-tour.png"))
            assert not problems, problems
        finally:
            browser.close()


def _run_all(page) -> None:
    """Run > Run All Cells, as a person would; again if no cell started (the notebook was not
    focused yet, say)."""
    started = ("() => Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))"
               ".some(e => /\\[(\\*|\\d+)\\]/.test(e.textContent))")
    for attempt in range(3):
        page.locator(".jp-Notebook .jp-Cell").first.click()
        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        try:
            page.wait_for_function(started, timeout=15_000)
            return
        except PlaywrightTimeout:
            page.keyboard.press("Escape")
    pytest.fail("Run > Run All Cells started no cell, three times", pytrace=False)


def _title(area) -> str:
    titles = area.locator(".js-plotly-plot .gtitle")
    return titles.first.text_content() if titles.count() else ""


def _wait_all_run(page, cells: int, server_log: Path) -> None:
    """Until every code cell shows an execution count (not ``[*]`` or ``[ ]``)."""
    deadline = time.monotonic() + RUN_ALL_S
    while True:
        prompts = _prompts(page)
        if len(prompts) == cells and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
            return
        if page.locator(".jp-OutputArea-output", has_text="Traceback").count():
            text = page.locator(".jp-NotebookPanel").inner_text()
            pytest.fail("a cell raised:\n" + _around(text, "Traceback"), pytrace=False)
        if time.monotonic() > deadline:
            pytest.fail(f"cells still not run after {RUN_ALL_S} s: {prompts}\n"
                        + server_log.read_text()[-3000:], pytrace=False)
        page.wait_for_timeout(500)


def _around(text: str, word: str, width: int = 1500) -> str:
    at = text.find(word)
    return text[max(0, at - 200): at + width] if at >= 0 else ""
