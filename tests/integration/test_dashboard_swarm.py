"""`node dashboard` against a real swarm on loopback, read in headless Chromium: the run page of a swarm without a
coordinator shows its live step and plots from the DHT's progress reports. Screenshot: ``swarm-run.png`` in
``tmp_path`` and ``tests/artifacts/dashboard/``."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.coordinator.test_dashboard import browser, screenshot, text, wait_for  # noqa: F401 (browser: a fixture)
from tests.swarm_helpers import Swarm

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
# `node dashboard` through its own add_parser/run_dashboard, as cli/main.py runs a command
DASHBOARD = ("import argparse, sys\n"
             "from swarmrun.node.cli import dashboard\n"
             "from swarmrun.node.output import Events\n"
             "from swarmrun.node.runtime import kill_descendants\n"
             "p = argparse.ArgumentParser(prog='node'); dashboard.add_parser(p.add_subparsers(dest='command'))\n"
             "events = Events(json_mode=True)\n"
             "try:\n    sys.exit(dashboard.run_dashboard(p.parse_args(sys.argv[1:]), events))\n"
             "finally:\n    kill_descendants()\n")


class Dashboard:
    """`node dashboard RUN --peers M --http 127.0.0.1:0 --json` in its own session, its JSON lines pumped to a queue."""

    def __init__(self, run_id: str, maddr: str, log: Path) -> None:
        self.lines: queue.Queue = queue.Queue()
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-c", DASHBOARD, "dashboard", run_id, "--peers", maddr,
                                      "--http", "127.0.0.1:0", "--interval", "1", "--json"], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                pass

    def url(self, timeout: float = 60) -> str:
        try:
            while True:
                event = self.lines.get(timeout=timeout)
                if event.get("event") == "dashboard":
                    return event["url"]
                assert event.get("event") != "error", event
        except queue.Empty:
            raise AssertionError(f"no dashboard event within {timeout}s: {Path(self.log.name).read_text()[-2000:]}") from None

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.log.close()


def _step(driver) -> int:
    return int(text(driver, "#facts dd.step").split("/")[0])


@pytest.mark.timeout(240)
def test_node_dashboard_shows_a_swarm_live(tmp_path, browser):  # noqa: F811
    with Swarm(tmp_path, "dash-run") as swarm:
        swarm.create("p0", "--task", "synthetic", "--set", "total_steps=100000", "--json")
        swarm.wait_for("p0", "progress", timeout=120)
        dashboard = Dashboard("dash-run", swarm.maddr, tmp_path / "dashboard.log")
        try:
            url = dashboard.url()
            browser.get(url)
            first = wait_for(lambda: _step(browser) > 0 and _step(browser), "the swarm's step", timeout=30)
            wait_for(lambda: _step(browser) > first, "the step to advance without a reload", timeout=60)
            assert text(browser, "#facts dd.state") == "running" and text(browser, "#facts dd.peers-reported") == "1"
            wait_for(lambda: len(browser.find_elements("css selector", "svg.plot circle")) >= 4, "the plots' points")
            assert "joined" in text(browser, "#events")
            assert browser.execute_script("return performance.getEntriesByType('navigation').length") == 1
            screenshot(browser, tmp_path, "swarm-run")
        finally:
            dashboard.stop()
