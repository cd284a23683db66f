"""``python -m swarmrun.node.cli``: what the `node` console script runs."""

import sys

from swarmrun.node.cli.main import main

sys.exit(main())
