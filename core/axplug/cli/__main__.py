"""`python -m axplug.cli` runs the `axplug` command."""

from axplug.cli.main import main

raise SystemExit(main())
