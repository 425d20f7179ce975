"""`python -m arlo.tracing summary DIR`: per span name, count and mean duration (arlo.tracing.summary)."""

from arlo.tracing.summary import main

raise SystemExit(main())
