"""Write the MaxText fixtures of tests/data/maxtext with MaxText itself (needs its venv: setup.sh).

    python referees/maxtext/make_fixtures.py [DST]   (default tests/data/maxtext)

For scan_layers True and False: MaxText trains the tiny GQA Llama (mt.TINY) for 3 steps on
synthetic data, checkpointing every 2 steps; the fixture is its step folder `2` (the state after
steps 0..2: `step` = 3), with MaxText's float32 logits of a fixed batch (tokens.npy) computed by
MaxText's own forward pass from that checkpoint, and `info.json` (model, losses).
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mt

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    dst = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "data" / "maxtext"
    dst.mkdir(parents=True, exist_ok=True)
    tokens = dst / "tokens.npy"
    rng = np.random.default_rng(0)
    np.save(tokens, rng.integers(0, mt.TINY["vocab_size"], (2, 16)).astype(np.int32))
    with tempfile.TemporaryDirectory() as tmp:
        for name, scan in (("scanned", True), ("unscanned", False)):
            run = Path(tmp) / name
            losses = mt.train(run, mt.TINY, steps=3, scan_layers=scan)
            out = dst / name
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(run / "x" / "checkpoints" / "2", out / "2")
            mt.forward(out / "2" / "items", tokens, out / "logits.npy", mt.TINY, scan_layers=scan)
            (out / "logits.log").unlink()
            info = {
                "model": mt.TINY,
                "scan_layers": scan,
                "steps": 3,
                "losses": losses,
                "step_dir": 2,
                "maxtext": "0.2.5",
            }
            (out / "info.json").write_text(json.dumps(info, indent=1) + "\n")
            print(name, losses)


if __name__ == "__main__":
    main()
