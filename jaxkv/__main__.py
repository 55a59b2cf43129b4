"""`python -m jaxkv`: the `jaxkv` command (`jaxkv.cli`)."""

import sys

from jaxkv.cli import main

sys.exit(main())
