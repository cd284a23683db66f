"""The `node` command line: one module per command group (main parses and dispatches; nothing heavy is imported
before the arguments are checked)."""

from swarmrun.node.cli.main import main

__all__ = ["main"]
