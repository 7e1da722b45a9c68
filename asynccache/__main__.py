"""``python -m asynccache``: the same as the ``asynccache`` command."""

from .cli import main

raise SystemExit(main())
