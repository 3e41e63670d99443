"""`python -m ucp_jax._src.cli`: the `ucp` command."""

import sys

from .main import main

sys.exit(main())
