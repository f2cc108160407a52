"""`python -m agent` is the same as the `agent` command."""

import sys

from agent.cli import main

sys.exit(main())
