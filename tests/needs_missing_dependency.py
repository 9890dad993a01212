"""A form module whose dependency is not installed."""

import definitely_missing_package_xyz  # noqa: F401
