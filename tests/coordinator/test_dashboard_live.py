"""The dashboard of a live pool in headless Chromium: `node coordinator`, two `node agent`s and a `synthetic` run
training on loopback, all through the CLI in their own process groups. The pages show the run's row with its live
step, the plots' points and the worker table; a keyboard user holds the run from its page and the hold takes effect
in the swarm (the agent's peer leaves). Every control of each page is checked keyboard-reachable and labelled, and
the run colours drawn are Okabe-Ito's. Screenshots (``live-pool.png``, ``live-run.png``, ``live-timeline.png``) go to
``tmp_path`` and ``tests/artifacts/dashboard/``; the README's come from this test.

Skipped only when Chromium or its driver is not installed (the README's test command installs them)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from swarmrun.coordinator import svg
from swarmrun.coordinator.client import Client
from tests.coordinator.test_dashboard import browser, keyboard_press, screenshot, text, wait_for  # noqa: F401
from tests.coordinator.test_pool_e2e import NODE, START_BOUND, Proc, _free_port, _wait, stop_pool

pytestmark = pytest.mark.timeout(600)

# Every focusable control of the page: reachable by Tab (not disabled, tabIndex >= 0) and with an accessible name
# (its text, aria-label, or a <label for>); returns the ones that are not, described.
UNREACHABLE_OR_UNLABELLED = """
return [...document.querySelectorAll('a[href], button, input, select, textarea, [tabindex]')]
  .filter(el => el.offsetParent !== null)
  .map(el => {
    const name = (el.getAttribute('aria-label') || (el.labels && [...el.labels].map(l => l.textContent).join(' '))
                  || el.textContent || '').trim();
    const problems = [];
    if (el.disabled || el.tabIndex < 0) problems.push('not reachable by keyboard');
    if (!name) problems.push('no label');
    return problems.length ? el.outerHTML.slice(0, 120) + ': ' + problems.join(', ') : null;
  })
  .filter(x => x);
"""
# the run colours drawn in the page, as #RRGGBB: the swatches of the tables and legend, the plots' points, the
# timeline's bars
RUN_COLOURS = """
const swatches = [...document.querySelectorAll('.swatch:not(.resident)')].map(s => {
  const m = getComputedStyle(s).backgroundColor.match(/\\d+/g).map(Number);
  return '#' + m.slice(0, 3).map(v => v.toString(16).padStart(2, '0')).join('');
});
const drawn = [...document.querySelectorAll('svg.plot circle, svg.timeline rect.bar')].map(e => e.getAttribute('fill'));
return swatches.concat(drawn).map(c => c.toUpperCase());
"""


def _accessible(driver, page: str) -> None:
    problems = driver.execute_script(UNREACHABLE_OR_UNLABELLED)
    assert problems == [], f"{page}: {problems}"
    colours = set(driver.execute_script(RUN_COLOURS))
    assert colours and colours <= set(svg.OKABE_ITO), f"{page}: run colours {colours} not all Okabe-Ito"


def _step(driver, css: str) -> int:
    value = text(driver, css).split("/")[0].strip()
    return int(value) if value.isdigit() else 0


def test_dashboard_of_a_live_pool(tmp_path, browser):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    coord_dir, port = tmp_path / "coordinator", _free_port()
    url = f"http://127.0.0.1:{port}"
    token = subprocess.run([*NODE, "coordinator", "user", "add", "alice", "--state-dir", str(coord_dir)], env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    env.update(SWARMRUN_TOKEN=token, SWARMRUN_COORDINATOR=url)
    client = Client(url, token)
    away, present = tmp_path / "away.json", tmp_path / "present.json"
    away.write_text(json.dumps([[0, False]]))  # w1's resident stays away: w1 trains
    present.write_text(json.dumps([[0, True]]))  # w2's resident is at the desk: w2 stays idle
    procs: list[Proc] = []
    try:
        coordinator = Proc("coordinator", ["coordinator", "--state-dir", str(coord_dir), "--http", f"127.0.0.1:{port}"],
                           tmp_path, env)
        procs.append(coordinator)
        coordinator.wait_event("serving", 60)
        agent_common = ["--device", "cpu", "--peer-arg=--matchmaking-time", "--peer-arg=1.0", "--stop-timeout", "20"]
        w1 = Proc("w1", ["agent", "--worker-id", "w1", "--state-dir", str(tmp_path / "w1"), "--resident",
                         f"script:{away}", *agent_common], tmp_path, env)
        w2 = Proc("w2", ["agent", "--worker-id", "w2", "--state-dir", str(tmp_path / "w2"), "--resident",
                         f"script:{present}", *agent_common], tmp_path, env)
        procs += [w1, w2]
        subprocess.run([*NODE, "submit", "r1", "--task", "synthetic", "--set", "total_steps=100000",
                        "--min-peers", "1", "--max-peers", "2"], env=env, check=True)
        w1.wait_event("peer_listening", START_BOUND, lambda e: e["run_id"] == "r1")
        _wait(lambda: client.get("runs/r1")["run"]["step"], START_BOUND, "a committed step reported")

        # the pool page: the run's row with its live step (moving without a reload), the worker table
        browser.get(url + "/")
        browser.find_element(By.ID, "token").send_keys(token, Keys.ENTER)
        first = wait_for(lambda: _step(browser, "#run-r1 .step"), "the run's row with its step")
        wait_for(lambda: _step(browser, "#run-r1 .step") > first, "the step to advance without a reload", timeout=90)
        assert browser.execute_script("return performance.getEntriesByType('navigation').length") == 1
        assert text(browser, "#run-r1 .state") == "running" and text(browser, "#run-r1 .peers") == "1 / 1 / 2"
        assert len(browser.find_elements(By.CSS_SELECTOR, "#workers tbody tr")) == 2
        assert text(browser, "#worker-w1 .doing") == "training r1" and text(browser, "#worker-w1 .resident") == "away"
        wait_for(lambda: text(browser, "#worker-w2 .resident") == "present", "w2's resident present")
        assert text(browser, "#worker-w2 .doing") == "idle"
        # the peer's evaluations (synthetic: every 5 steps), forwarded by its agent: the row's last eval loss
        wait_for(lambda: "@ step" in text(browser, "#run-r1 .eval-loss"), "the run's last eval loss", timeout=90)
        _accessible(browser, "pool page")
        screenshot(browser, tmp_path, "live-pool")

        # the run page: plots with points (loss against the samples the agents report), its worker
        browser.get(url + "/runs/r1")
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "svg.plot")[0]
                             .find_elements(By.TAG_NAME, "circle")) >= 3, "the loss plot's points", timeout=60)
        assert browser.find_elements(By.CSS_SELECTOR, "svg.plot")[0].get_attribute("aria-label") == "loss against samples"
        assert text(browser, "#facts dd.workers") == "w1" and _step(browser, "#facts dd.step") > 0
        # eval points drawn apart from the training loss (diamonds, with a legend), and the data cursor's accounting
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "svg.plot")[0].find_elements(By.CSS_SELECTOR, "path.overlay"),
                 "the loss plot's eval points")
        assert "eval loss" in browser.find_elements(By.CSS_SELECTOR, "svg.plot")[0].find_element(
            By.CSS_SELECTOR, "g.legend").get_attribute("textContent")
        assert "@ step" in text(browser, "#facts dd.last-eval-loss")
        assert int(text(browser, "#facts dd.blocks-applied")) > 0 and text(browser, "#facts dd.blocks-skipped") == "0"
        assert int(text(browser, "#facts dd.samples-applied")) > 0
        _accessible(browser, "run page")
        screenshot(browser, tmp_path, "live-run")

        browser.get(url + "/timeline")
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect.bar"), "w1's bar in r1")
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect.resident"), "w2's resident span")
        _accessible(browser, "timeline page")
        screenshot(browser, tmp_path, "live-timeline")

        # hold from the run page, by keyboard: the registry holds the run and the swarm's peer leaves
        browser.get(url + "/runs/r1")
        wait_for(lambda: text(browser, "#facts dd.state") == "running", "the run page")
        keyboard_press(browser, "Hold")
        stopped = w1.wait_event("peer_stopped", 60, lambda e: e["run_id"] == "r1")
        assert stopped["left"] == "stopped" and not stopped["killed"]
        _wait(lambda: client.get("runs/r1")["run"]["workers"] == [], 30, "w1 released in the registry")
        assert client.get("runs/r1")["run"]["state"] == "held"
        wait_for(lambda: text(browser, "#facts dd.state") == "held", "the page to show the run held")
        wait_for(lambda: text(browser, "#facts dd.workers") == "none", "the page to show no worker on the run")
    finally:
        stop_pool(procs, agents=procs[1:])
