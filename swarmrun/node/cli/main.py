"""The `node` command (also installed as `swarmrun`, for machines where `node` is Node.js)."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from swarmrun.node.cli.common import EXIT_CODES, swarm_args


COMMANDS = {  # command -> (module of swarmrun.node.cli, function(args, events) -> exit code)
    "join": ("join", "run_join"), "keep": ("join", "run_keep"), "demo": ("demo", "run_demo"),
    "status": ("status", "run_status"), "snapshot": ("snapshot", "run_command"), "pause": ("snapshot", "run_command"),
    "invite": ("access", "run_command"), "identity": ("access", "run_command"),
    "coordinator": ("pool", "run_coordinator"), "agent": ("pool", "run_agent"), "submit": ("pool", "run_submit"),
    "runs": ("pool", "run_runs"), "hold": ("pool", "run_action"), "release": ("pool", "run_action"),
    "cancel": ("pool", "run_action"), "dashboard": ("dashboard", "run_dashboard"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="node", description="swarmrun: a training run that outlives its machines.",
                                epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    from swarmrun.node.cli import access, dashboard, demo, join, pool, snapshot, status

    join.add_parsers(sub)
    demo.add_parser(sub)
    status.add_parser(sub)
    sub.add_parser("tasks", help="list the installed tasks")
    snapshot.add_parsers(sub, epilog=EXIT_CODES, swarm_args=swarm_args)
    access.add_parsers(sub, epilog=EXIT_CODES, swarm_args=swarm_args)
    pool.add_parsers(sub)
    dashboard.add_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits 2 on a bad flag, with usage
    if args.command == "tasks":
        return _tasks()
    from swarmrun.protocol.errors import SwarmrunError
    from swarmrun.node.output import Events, setup_logging

    json_mode = getattr(args, "json", False)
    setup_logging(json_mode=json_mode, verbose=getattr(args, "verbose", False))
    events = Events(json_mode=json_mode)
    try:
        return _command(args.command)(args, events)
    except SwarmrunError as e:
        events.emit("error", code=e.exit_code, kind=type(e).__name__, message=str(e))
        return e.exit_code
    except KeyboardInterrupt:
        events.emit("error", code=1, kind="KeyboardInterrupt", message="interrupted")
        return 1
    except Exception as e:  # unexpected: one line for the user, the traceback with -v
        import logging

        logging.getLogger("swarmrun").debug("unexpected error", exc_info=True)
        events.emit("error", code=1, kind=type(e).__name__, message=f"unexpected: {e}")
        return 1
    finally:
        events.close()
        from swarmrun.node.runtime import kill_descendants

        kill_descendants()


def _command(name: str):
    """The function that runs command ``name`` (each command group's module, imported only when used)."""
    from importlib import import_module

    module, function = COMMANDS[name]
    return getattr(import_module(f"swarmrun.node.cli.{module}"), function)


def _tasks() -> int:
    from swarmrun.node.tasks.base import available_tasks

    for name in sorted(available_tasks()):
        print(name)
    return 0
