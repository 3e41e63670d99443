"""MaxText as the referee of `ucp convert maxtext` / `ucp export maxtext` (make referees).

    python referees/maxtext/referee.py [OUT]      (default $REF_DIR/ucp-maxtext)

Needs MaxText's venv (referees/maxtext/setup.sh). What it shows, each as a line of a JSON report
(OUT/report.json) and an exit status of 1 if a check fails:

1. resume-1dev: MaxText (1 device) trains 6 steps, checkpointing every 2; its checkpoint 2 goes
   through `ucp convert maxtext` and `ucp export maxtext`; MaxText resumes from the export on 1
   device: steps 3..5 have the losses of the uninterrupted run (relative <= 1e-5).
2. resume-2dev: MaxText resumes on 2 devices from the export, and from its own 1-device
   checkpoint: the same losses (relative <= 1e-5).
3. unscanned: a float32 run's checkpoint exported with scan_layers=False; MaxText
   (scan_layers=False) resumes from it with the losses of the scanned float32 run (<= 1e-5).
4. logits: `ucp_jax.models.llama` restored from the converted checkpoint gives MaxText's own
   float32 logits of a fixed batch (max abs difference <= 1e-4).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mt  # noqa: E402

RTOL = 1e-5


def rel(a: list[float], b: list[float]) -> float:
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(x - y) / np.abs(y))) if len(x) == len(y) else float("inf")


def ucp_logits(ckpt: str, tokens: np.ndarray) -> np.ndarray:
    import jax

    import ucp_jax as ucp
    from ucp_jax.models import llama
    from ucp_jax.models.parallel import Layout

    cfg = llama.config_from_checkpoint(ckpt)
    layout = Layout()
    mesh = llama.make_mesh(layout)
    params = ucp.restore(ckpt, llama.abstract_params(cfg, layout, mesh),
                         rules=llama.ucp_rules(cfg, layout))[0]  # fmt: skip
    with jax.default_matmul_precision("highest"):
        return np.asarray(llama.make_logits_fn(cfg, layout, mesh)(params, tokens))


def main() -> int:
    from ucp_jax._src.cli import main as ucp

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else mt.REF_DIR / "ucp-maxtext"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    report: dict[str, object] = {}
    ok = True

    def check(name: str, passed: bool, **facts: object) -> None:
        nonlocal ok
        ok = ok and passed
        report[name] = {"pass": passed, **facts}
        print(name, "PASS" if passed else "FAIL", json.dumps(facts))

    t0 = time.time()
    full = mt.train(out / "full", mt.MODEL, steps=6)
    own = out / "full" / "x" / "checkpoints" / "2"
    conv, exp = out / "ucp", out / "export"
    assert ucp(["convert", "maxtext", str(own), str(conv)]) == 0
    assert ucp(["export", "maxtext", str(conv), str(exp)]) == 0
    steps1, res1 = mt.resume(out / "resume-1dev", exp / "2", 2, mt.MODEL, steps=6)
    check("resume-1dev", steps1 == [3, 4, 5] and rel(res1, full[3:]) <= RTOL,
          steps=steps1, losses=res1, uninterrupted=full[3:], rel=rel(res1, full[3:]))  # fmt: skip
    _, own2 = mt.resume(out / "own-2dev", own, 2, mt.MODEL, steps=6, ndev=2)
    steps2, res2 = mt.resume(out / "resume-2dev", exp / "2", 2, mt.MODEL, steps=6, ndev=2)
    check("resume-2dev", steps2 == [3, 4, 5] and rel(res2, own2) <= RTOL,
          steps=steps2, losses=res2, own_checkpoint=own2, rel=rel(res2, own2))  # fmt: skip
    # scanned -> unscanned: another loop, so compared in float32 (MaxText computes in bf16 by
    # default, where the two loops round differently)
    f32 = {**mt.MODEL, "dtype": "float32"}
    full32 = mt.train(out / "full-f32", f32, steps=6)
    conv32, unscanned = out / "ucp-f32", out / "export-unscanned"
    assert ucp(["convert", "maxtext", str(out / "full-f32" / "x" / "checkpoints" / "2"),
                str(conv32)]) == 0  # fmt: skip
    assert ucp(["export", "maxtext", str(conv32), str(unscanned), "--unscanned"]) == 0
    steps3, res3 = mt.resume(out / "resume-unscanned", unscanned / "2", 2, f32, steps=6,
                             scan_layers=False)  # fmt: skip
    check("unscanned", steps3 == [3, 4, 5] and rel(res3, full32[3:]) <= RTOL,
          steps=steps3, losses=res3, scanned_f32=full32[3:], rel=rel(res3, full32[3:]))  # fmt: skip
    tokens = out / "tokens.npy"
    rng = np.random.default_rng(1)
    np.save(tokens, rng.integers(0, mt.MODEL["vocab_size"], (2, 24)).astype(np.int32))
    mt.forward(own / "items", tokens, out / "maxtext_logits.npy", mt.MODEL)
    want = np.load(out / "maxtext_logits.npy")
    got = ucp_logits(str(conv), np.load(tokens))
    diff = float(np.abs(got - want).max())
    check("logits", diff <= 1e-4, max_abs_diff=diff, max_abs_logit=float(np.abs(want).max()))
    report["seconds"] = round(time.time() - t0, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print("report:", out / "report.json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
