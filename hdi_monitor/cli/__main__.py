"""``python -m hdi_monitor.cli``: the ``hdi-monitor`` command."""

import sys

from hdi_monitor.cli import main

sys.exit(main())
