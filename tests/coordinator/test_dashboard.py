"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` + ``chromium-driver``) against
the coordinator's Starlette app served by uvicorn on loopback, over an SQLite registry filled through its own
API. No fake browser, no mock database. Screenshots go to ``tmp_path`` and ``tests/artifacts/dashboard/``.

Skipped only when Chromium or its driver is not installed (``apt-get install -y chromium chromium-driver``).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from swarmrun.coordinator.api import make_app
from swarmrun.coordinator.registry import Registry
from swarmrun.coordinator.schema import Heartbeat, parse_progress, parse_registration, parse_submission

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "dashboard"
WAIT = 15.0  # seconds for any state to show in the page (the page polls every 2 s)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--window-size=1280,1100"]
CURSOR = {"samples_applied": 0, "blocks_applied": 0, "blocks_pending": 200, "blocks_skipped": 0, "blocks_duplicated": 0,
          "data_epoch": 0}
# Mark labels of each plot that overprint one another (their boxes as the browser lays them out), and marks
# without a tooltip; returns them described.
OVERPRINTED_MARKS = """
const problems = [];
for (const plot of document.querySelectorAll('svg.plot')) {
  const boxes = [...plot.querySelectorAll('text.marklabel')].map(t => [t.textContent, t.getBBox()]);
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
    const [a, p] = boxes[i], [b, q] = boxes[j];
    if (p.x < q.x + q.width && q.x < p.x + p.width && p.y < q.y + q.height && q.y < p.y + p.height)
      problems.push(plot.getAttribute('aria-label') + ': ' + a + ' over ' + b);
  }
  for (const g of plot.querySelectorAll('g.mark'))
    if (!g.querySelector('title') || !g.querySelector('title').textContent) problems.push('a mark with no tooltip');
}
return problems;
"""
RESOURCES = {"devices": [{"kind": "cuda", "memory_gib": 24}], "cpus": 8, "ram_gib": 64}


def _chromium() -> tuple[str, str]:
    binary = shutil.which("chromium") or (CHROMIUM if Path(CHROMIUM).exists() else None)
    driver = shutil.which("chromedriver") or (CHROMEDRIVER if Path(CHROMEDRIVER).exists() else None)
    if not binary or not driver:
        pytest.skip("headless Chromium is not installed: apt-get install -y chromium chromium-driver")
    return binary, driver


def populate(registry: Registry) -> dict[str, str]:
    """A pool as a coordinator records it: users, two runs, three workers, assignments, progress, a resident back."""
    tokens = {"alice": registry.add_user("alice"), "lab": registry.add_user("lab")}
    registry.submit("alice", parse_submission({"run_id": "big", "task": "synthetic", "task_args": {}, "priority": "low",
                                               "min_peers": 1, "max_peers": 3, "total_steps": 50}))
    registry.submit("alice", parse_submission({"run_id": "small", "task": "synthetic", "task_args": {},
                                               "priority": "high", "min_peers": 1, "max_peers": 1}))
    for w in ("w1", "w2", "w3"):
        registry.register_worker(parse_registration({"worker_id": w, "hostname": f"desk-{w}", "resources": RESOURCES}),
                                 owner="lab")
        registry.heartbeat(w, Heartbeat(resident_present=False))
    registry.set_run_state("big", "running", expect="pending", reason="start")
    registry.assign("w1", "big")
    registry.assign("w2", "big")
    for step in range(1, 6):
        snapshot = {"snapshot": {"url": "file:///snapshots/big", "step": 3}} if step == 3 else {}
        cursor = {"cursor": {**CURSOR, "samples_applied": 256 * step, "blocks_applied": 32 * step}}
        registry.report_progress("big", parse_progress({"step": step, "loss": 3.0 / step, "samples_per_second": 90.0 + step,
                                                        "peers": 2, "samples": 256 * step, **snapshot, **cursor}))
        if step % 2 == 0:  # the peers' evaluations, as agents forward them
            registry.report_progress("big", parse_progress({"step": step, "eval": {"step": step, "loss": 2.5 / step}}))
        time.sleep(0.01)  # distinct times on the time axes
    registry.heartbeat("w2", Heartbeat(resident_present=True))  # w2's resident is back: the loop hands it back
    registry.unassign("w2", reason="resident_return")
    for _ in range(2):  # more marks at the same moment: their labels must not overprint
        registry.set_run_state("big", "paused", expect="running", reason="pause")
        registry.set_run_state("big", "running", expect="paused", reason="resume")
    registry.set_run_state("small", "running", expect="pending", reason="start")
    registry.assign("w3", "small")
    return tokens


class Served:
    """The coordinator's app (API and pages) served by uvicorn in a thread on a free loopback port."""

    def __init__(self, registry: Registry) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))  # bound here and handed over: no race for the port
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(make_app(registry, pages=True), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture
def served(tmp_path):
    registry = Registry(f"sqlite:///{tmp_path / 'coordinator.db'}")
    tokens = populate(registry)
    server = Served(registry)
    yield server, registry, tokens
    server.stop()
    registry.close()


@pytest.fixture
def browser():
    binary, driver_path = _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="swarmrun-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for(condition, what: str, timeout: float = WAIT):
    """Poll ``condition`` (a function returning a truthy value or raising) until it holds, up to ``timeout``."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except Exception as e:  # an element replaced under us by the next poll: look again
            last = e
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last!r})")


def screenshot(driver, tmp_path: Path, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, max(800, min(height + 200, 6000)))  # the whole page, not only its first screen
    for folder in (tmp_path, ARTIFACTS):
        assert driver.save_screenshot(str(folder / f"{name}.png"))


def text(driver, css: str) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css).text


def keyboard_press(driver, label: str, tabs: int = 30) -> None:
    """Tab through the page to the button labelled ``label`` and press it with Enter, as a keyboard user would."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    driver.find_element("tag name", "body").click()
    for _ in range(tabs):
        ActionChains(driver).send_keys(Keys.TAB).perform()
        active = driver.switch_to.active_element
        if active.tag_name == "button" and active.text == label:
            ActionChains(driver).send_keys(Keys.ENTER).perform()
            return
    raise AssertionError(f"no button {label!r} within {tabs} tab stops")


@pytest.mark.timeout(180)
def test_pages_show_the_pool_live_and_act_on_it(served, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    server, registry, tokens = served
    browser.get(server.url + "/")
    wait_for(lambda: "API token" in text(browser, "#status"), "the page to ask for a token")  # no token: no data
    assert browser.find_elements(By.CSS_SELECTOR, "#runs") == []
    token_input = browser.find_element(By.ID, "token")
    token_input.send_keys(tokens["alice"], Keys.ENTER)

    wait_for(lambda: text(browser, "#run-big .step") == "5 / 50", "the run's row with its step")
    assert text(browser, "#run-big .eval-loss") == "0.625 @ step 4" and text(browser, "#run-big .loss") == "0.6"
    assert text(browser, "#run-small .eval-loss") == "–"
    assert text(browser, "#run-big .state") == "running" and text(browser, "#run-big .peers") == "1 / 1 / 3"
    assert "training big" in text(browser, "#worker-w1 .doing")
    assert text(browser, "#worker-w2 .doing") == "idle" and text(browser, "#worker-w2 .resident") == "present"
    assert "training small" in text(browser, "#worker-w3 .doing")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#workers tbody tr")) == 3

    registry.report_progress("big", parse_progress({"step": 6, "loss": 0.5, "samples_per_second": 97.0, "peers": 1}))
    updated = wait_for(lambda: text(browser, "#run-big .step") == "6 / 50", "the new step without a reload")
    assert updated and browser.execute_script("return performance.getEntriesByType('navigation').length") == 1
    screenshot(browser, tmp_path, "pool")

    browser.get(server.url + "/runs/big")  # the token is remembered (localStorage)
    circles = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "svg.plot circle"), "the plots' points")
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.plot")[0].find_elements(By.TAG_NAME, "circle")) == 6
    assert len(circles) >= 6 * 2
    assert "handed back w2" in text(browser, "#events") and "snapshot @3" in text(browser, "#events")
    loss_plot = browser.find_elements(By.CSS_SELECTOR, "svg.plot")[0]
    assert loss_plot.get_attribute("aria-label") == "loss against step"  # the step-6 report above had no samples
    diamonds = loss_plot.find_elements(By.CSS_SELECTOR, "path.overlay")
    assert len(diamonds) == 2 and {d.get_attribute("stroke") for d in diamonds} == {"#000000"}
    assert [t.get_attribute("textContent") for t in loss_plot.find_elements(By.CSS_SELECTOR, "g.legend text")] == [
        "training loss", "eval loss"]
    assert text(browser, "#facts dd.last-eval-loss") == "0.625 @ step 4"
    assert text(browser, "#facts dd.blocks-applied") == "160" and text(browser, "#facts dd.samples-applied") == "1280"
    assert text(browser, "#facts dd.blocks-skipped") == "0" and text(browser, "#facts dd.blocks-pending") == "200"
    marks = browser.find_elements(By.CSS_SELECTOR, "svg.plot g.mark")
    assert len(marks) >= 2 * 6 and browser.find_elements(By.CSS_SELECTOR, "svg.plot text.marklabel")
    overprinted = browser.execute_script(OVERPRINTED_MARKS)
    assert overprinted == [], overprinted
    unlabelled = browser.execute_script(
        "return [...document.querySelectorAll('button')].filter(b => !b.textContent.trim()).length"
        " + [...document.querySelectorAll('input')].filter(i => !document.querySelector('label[for=\"'+i.id+'\"]')).length")
    assert unlabelled == 0
    screenshot(browser, tmp_path, "run")

    keyboard_press(browser, "Hold")
    wait_for(lambda: registry.run("big")["state"] == "held", "the registry to hold the run")
    wait_for(lambda: text(browser, "#facts dd.state") == "held", "the page to show the run held")
    assert "hold: run big is held" in text(browser, "#status")
    browser.find_element(By.ID, "priority").send_keys("2")
    keyboard_press(browser, "Set priority")
    wait_for(lambda: registry.run("big")["priority"] == 2, "the registry to take the new priority")
    keyboard_press(browser, "Cancel")
    wait_for(lambda: registry.run("big")["state"] == "cancelled", "the registry to cancel the run")
    keyboard_press(browser, "Release")  # a cancelled run cannot be released: the API's refusal is shown
    wait_for(lambda: "release refused" in text(browser, "#status"), "the refusal in the status line")

    browser.get(server.url + "/timeline")
    bars = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect.bar"), "the timeline's bars")
    assert len(bars) == 3  # w1 and w2 in big, w3 in small
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect.resident")) == 1
    screenshot(browser, tmp_path, "timeline")
