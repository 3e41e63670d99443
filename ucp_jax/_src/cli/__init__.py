"""The `ucp` command: inspect and verify universal checkpoints; convert from / export to PyTorch.

`main.py` parses the command line; `checkpoints.py` looks at, checks, lists and deletes
universal checkpoints and plans restores; `foreign.py` converts and exports other trainers'
checkpoints; `args.py` checks the arguments that name things; `text.py` prints names safely.
"""

from .args import CliError
from .checkpoints import (
    delete_command,
    inspect_checkpoint,
    list_command,
    plan_command,
    verify_checkpoint,
)
from .main import main

__all__ = [
    "CliError",
    "delete_command",
    "inspect_checkpoint",
    "list_command",
    "main",
    "plan_command",
    "verify_checkpoint",
]
