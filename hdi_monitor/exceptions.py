"""The public warnings and errors of hdi-monitor, in one place.

Filter them like any warning, e.g. ``warnings.simplefilter("ignore", DiversityWarning)``, or turn
monitoring errors into exceptions with ``warnings.simplefilter("error", MonitoringWarning)`` (or
``strict=True``).
"""

from __future__ import annotations

__all__ = ["AdapterMismatch", "DiversityWarning", "MonitoringWarning"]


class MonitoringWarning(UserWarning):
    """An internal error inside monitoring, turned into a warning so that training goes on."""


class DiversityWarning(UserWarning):
    """Warning category for head-diversity events (saturation, collapse, redundant heads).

    Filter it like any warning, e.g. ``warnings.simplefilter("ignore", DiversityWarning)``.
    """


class AdapterMismatch(ValueError):
    """A module looks like an attention layer but its shapes do not fit the family's layout."""
