"""`python -m kvq ...` is the `kvq` command line."""

from kvq.cli import main

raise SystemExit(main())
