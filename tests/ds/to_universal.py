"""Convert DeepSpeed checkpoints with DeepSpeed's own ds_to_universal, several in one process.

    python tests/ds/to_universal.py IN_FOLDER OUT_FOLDER [IN_FOLDER OUT_FOLDER ...]

IN_FOLDER is a tag folder (e.g. ckpt/global_step3). Runs in-process with one worker (DeepSpeed's
"unit testing" path), so DeepSpeed is imported once; the result is what the CLI writes.
"""

from __future__ import annotations

import argparse
import sys

from deepspeed.checkpoint import ds_to_universal


def main(argv: list[str]) -> None:
    if len(argv) % 2:
        raise SystemExit("usage: to_universal.py IN OUT [IN OUT ...]")
    for src, dst in zip(argv[::2], argv[1::2]):
        args = argparse.Namespace(
            input_folder=src,
            output_folder=dst,
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,
        )
        ds_to_universal.main(args)


if __name__ == "__main__":
    main(sys.argv[1:])
