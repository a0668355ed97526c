"""``python -m hdi_monitor.cli``: the same as the ``hdi-monitor`` console script."""

from hdi_monitor.cli import main

raise SystemExit(main())
