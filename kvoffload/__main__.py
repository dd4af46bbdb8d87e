"""``python -m kvoffload``: the same CLI as the ``kvoffload`` command."""

from kvoffload.tools.cli import main

raise SystemExit(main())
