"""`python -m flash_catalog.cli`: the `flash-catalog` command."""

from .main import main

raise SystemExit(main())
