"""What a peer tells its user: events (one JSON object a line with ``--json``), a live progress line, logs.

Every log record carries ``run_id``, ``peer_id`` and ``step``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Iterable, Optional, Sequence


class _Context(logging.Filter):
    def __init__(self):
        super().__init__()
        self.run_id, self.peer_id, self.step = "-", "-", "-"

    def filter(self, record: logging.LogRecord) -> bool:
        record.run_id, record.peer_id, record.step = self.run_id, self.peer_id, self.step
        return True


_context = _Context()


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(dict(event="log", level=record.levelname.lower(), logger=record.name, run_id=record.run_id,
                               peer_id=record.peer_id, step=record.step, message=record.getMessage()))


def setup_logging(*, json_mode: bool, verbose: bool = False) -> None:
    """Log records to stderr: a human line, or one JSON object a line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_context)
    if json_mode:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(run_id)s %(peer_id)s step=%(step)s] %(message)s", "%H:%M:%S"))
    root = logging.getLogger("swarmrun")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False
    _hivemind["verbose"] = verbose
    if "hivemind" in sys.modules:  # otherwise net/swarm.py calls it once hivemind is imported (a usage error of a
        quiet_hivemind()           # command must not wait for hivemind's import)


_hivemind = {"verbose": False}


def quiet_hivemind() -> None:
    """hivemind logs through its own handler: keep it quiet unless ``-v`` (call once hivemind is imported)."""
    verbose = _hivemind["verbose"]
    logging.getLogger("hivemind").setLevel(logging.INFO if verbose else logging.ERROR)
    try:
        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("nowhere" if not verbose else "in_root_logger")
    except Exception:
        pass


def set_log_context(*, run_id: Optional[str] = None, peer_id: Optional[str] = None, step: Optional[int] = None) -> None:
    if run_id is not None:
        _context.run_id = run_id
    if peer_id is not None:
        _context.peer_id = peer_id[-8:]
    if step is not None:
        _context.step = str(step)


class Events:
    """Emits events: JSON lines on stdout with ``--json``; otherwise human lines and a rich live line."""

    def __init__(self, *, json_mode: bool, stream=None):
        self.json_mode = json_mode
        self.stream = stream or sys.stdout
        self._live = None
        if not json_mode:
            from rich.console import Console

            self.console = Console(file=self.stream, highlight=False)
            if not self.console.is_terminal:  # piped: one record a line, never wrapped at 80 columns
                self.console = Console(file=self.stream, highlight=False, soft_wrap=True, width=10_000)
            self.errors = Console(stderr=True, highlight=False, soft_wrap=True)

    def emit(self, event: str, **fields: Any) -> None:
        if self.json_mode:
            self.stream.write(json.dumps(dict(event=event, time=round(time.time(), 3), **fields)) + "\n")
            self.stream.flush()
            return
        if event == "progress":
            if self.console.is_terminal:  # piped, the step lines say it (one a step, not one a report)
                self._progress_line(fields)
        elif event == "transfer_progress":
            self._transfer_line(fields)
        else:
            self._stop_live()
            (self.errors if event == "error" else self.console).print(_human(event, fields))

    def table(self, title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
        """A rich table on a terminal; piped, the title and then one tab-separated line a row (a header first):
        never boxed or wrapped, so each row is one line for grep, cut and awk (issue 19)."""
        self._stop_live()
        if self.console.is_terminal:
            from rich.table import Table

            table = Table(*columns, title=title or None)
            for row in rows:
                table.add_row(*row)
            self.console.print(table)
            return
        lines = ([title] if title else []) + ["\t".join(columns)] + ["\t".join(row) for row in rows]
        self.stream.write("".join(line + "\n" for line in lines))
        self.stream.flush()

    def _progress_line(self, f: dict) -> None:
        from rich.text import Text

        eta = f.get("eta_s")
        eta_s = "-" if eta is None else f"{int(eta) // 60}m{int(eta) % 60:02d}s"
        loss = f.get("loss")
        text = Text.assemble(
            ("step ", "dim"), (f"{f['step']}/{f['total_steps']}", "bold"),
            ("  loss ", "dim"), ("-" if loss is None else f"{loss:.4f}", "cyan"),
            ("  samples/s ", "dim"), (f"{f.get('samples_per_second', 0):.1f}", ""),
            ("  peers ", "dim"), (str(f.get("peers", 1)), ""),
            ("  ETA ", "dim"), (eta_s, ""),
        )
        if self._live is None:
            from rich.live import Live

            self._live = Live(text, console=self.console, refresh_per_second=4, transient=False)
            self._live.start()
        else:
            self._live.update(text)

    def _transfer_line(self, f: dict) -> None:
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        total = max(1, f["total_bytes"])
        line = Table.grid(padding=(0, 1))
        line.add_row(f"fetching state of step {f['step']}", ProgressBar(total=total, completed=f["bytes"], width=30),
                     f"{f['bytes'] / 2**20:.1f}/{total / 2**20:.1f} MiB", f"{f['mb_per_s']} MiB/s",
                     f"{f['providers']} provider(s)")
        if not self.console.is_terminal:
            if f["bytes"] >= total:
                self.console.print(line)
            return
        if self._live is None:
            from rich.live import Live

            self._live = Live(line, console=self.console, refresh_per_second=4, transient=True)
            self._live.start()
        else:
            self._live.update(line)

    def _stop_live(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def close(self) -> None:
        self._stop_live()


def _human(event: str, f: dict) -> str:
    if event == "listening":
        lines = "\n".join(f"  {m}" for m in f.get("maddrs", []))
        return f"[bold]run {f.get('run_id')}[/bold]: peer {f.get('peer_id')} listening; others join with --peers and one of:\n{lines}"
    if event == "error":
        return f"[red]error[/red]: {f.get('message')}"
    if event == "identity":  # what an invitee sends the owner: the peer id, alone on its line first
        return f"{f.get('peer_id')}\n  (peer id of the identity in {f.get('state_dir')}" + \
            (f"; file {f['file']})" if f.get("file") else ")")
    if event == "eval":
        return f"step {f.get('step')}: eval loss {f.get('loss'):.4f}"
    if event == "step":
        loss = f.get("loss")
        return (f"step {f.get('step')}/{f.get('total_steps')}  loss {'-' if loss is None else f'{loss:.4f}'}  "
                f"samples {f.get('samples')}  peers {f.get('peers')}  round {f.get('round_s', 0):.2f}s  "
                f"state {str(f.get('state_hash', ''))[:12]}")
    # a step's block ranges are for machines (--json): the cursor's counts tell a person enough
    details = " ".join(f"{k}={v}" for k, v in f.items() if k not in ("run_id", "peer_id", "blocks"))
    return f"{event}: {details}"
