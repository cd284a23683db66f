"""What an open dashboard costs the coordinator: its process's CPU time over a window, with no page open and
with a headless Chromium polling a page (every 2 s), while a run reports progress once a second.

    python -m benchmarks.dashboard_cpu --seconds 20 --points 2000

The coordinator here is the API app with its pages (``make_app(pages=True)``) served by uvicorn in a child
process over an SQLite registry holding a run with ``--points`` progress events (the run page plots them all);
a thread in that process reports one more step a second, as agents would. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, threading, time, uvicorn
from swarmrun.coordinator.api import make_app
from swarmrun.coordinator.registry import Registry
from swarmrun.coordinator.schema import parse_progress, parse_registration, parse_submission
db, port, points = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
reg = Registry(f"sqlite:///{db}")
token = reg.add_user("alice")
reg.submit("alice", parse_submission({"run_id": "big", "task": "synthetic", "task_args": {}, "max_peers": 4,
                                      "total_steps": 10 * points}))
for w in range(4):
    reg.register_worker(parse_registration({"worker_id": f"w{w}", "hostname": f"desk{w}",
                        "resources": {"devices": [], "cpus": 8, "ram_gib": 32}}), owner="alice")
reg.set_run_state("big", "running", expect="pending", reason="start")
for w in range(3):
    reg.assign(f"w{w}", "big")
for s in range(points):
    reg.report_progress("big", parse_progress({"step": s, "loss": 3.0 / (1 + s), "samples_per_second": 100.0, "peers": 3}))
def report():
    s = points
    while True:
        time.sleep(1.0)
        reg.report_progress("big", parse_progress({"step": s, "loss": 3.0 / (1 + s), "samples_per_second": 100.0, "peers": 3}))
        s += 1
threading.Thread(target=report, daemon=True).start()
print(token, flush=True)
uvicorn.run(make_app(reg, pages=True), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
"""


def _cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _browser(profile: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=options)


def _window(pid: int, seconds: float) -> float:
    before = _cpu(pid)
    time.sleep(seconds)
    return _cpu(pid) - before


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--points", type=int, default=2000)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="swarmrun-dashcpu-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp / "c.db"), str(port), str(args.points)],
                             stdout=subprocess.PIPE, text=True)
    driver = None
    try:
        token = child.stdout.readline().strip()
        url = f"http://127.0.0.1:{port}"
        time.sleep(2.0)  # uvicorn up, the reporter thread running
        result = {"seconds": args.seconds, "points": args.points, "idle_cpu_s": _window(child.pid, args.seconds)}
        driver = _browser(str(tmp / "profile"))
        for page in ("/", "/runs/big", "/timeline"):
            driver.get(url + page)
            driver.execute_script("localStorage.setItem('swarmrun.token', arguments[0])", token)
            driver.refresh()
            time.sleep(3.0)  # the first fetch folds every event once: not the steady state
            result[f"open {page} cpu_s"] = _window(child.pid, args.seconds)
        for key in [k for k in result if k.startswith("open")]:
            result[key.replace("cpu_s", "added_pct_of_a_core")] = round(
                100 * (result[key] - result["idle_cpu_s"]) / args.seconds, 2)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    finally:
        if driver is not None:
            driver.quit()
        child.kill()
        child.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
