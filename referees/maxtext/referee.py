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
4. crossing: MaxText (float32) -> `ucp_jax.models.llama` on an FSDP 2 x TP 2 mesh: its loss of
   MaxText's synthetic batch equals MaxText's step-3 loss; after one JAX AdamW step, saved and
   exported with its weights and Adam moments, MaxText resumes and its first loss equals the
   JAX loss of that state (both relative <= 1e-4).
5. transformers -> MaxText: a random transformers Llama (PyTorch) through `ucp convert hf` and
   `ucp export maxtext --params-only`: MaxText's own forward gives transformers' logits (<= 1e-4).
6. logits: `ucp_jax.models.llama` restored from the converted checkpoint gives MaxText's own
   float32 logits of a fixed batch (max abs difference <= 1e-4).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # our JAX side
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mt

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


def synthetic_batch(out: Path, model: dict) -> np.ndarray:
    """MaxText's synthetic batch (1 device): its randint of PRNGKey(0), computed by MaxText's jax."""
    import subprocess

    path = out / "synthetic.npy"
    code = ("import sys, jax, numpy as np; jax.config.update('jax_default_prng_impl', 'unsafe_rbg');"
            f"t = jax.random.randint(jax.random.PRNGKey(0), (1, {model['max_target_length'] + 1}),"
            f" 0, {model['vocab_size']}, dtype=jax.numpy.int32); np.save(sys.argv[1], np.asarray(t))")  # fmt: skip
    subprocess.run([str(mt.PY), "-c", code, str(path)], check=True, env=mt.env(1))
    return np.load(path)


def crossing_jax(out: Path, conv32: Path, full32: list[float], f32: dict) -> dict:
    """MaxText -> ucp_jax.models.llama (fsdp 2 x tp 2) -> one AdamW step -> MaxText.

    The first loss after each crossing must equal the source's loss on the same batch: JAX's
    loss of the MaxText checkpoint 2 is MaxText's step-3 loss; MaxText's first loss when it
    resumes from JAX's state (weights and Adam moments) is JAX's loss of that state.
    """
    import jax
    import optax

    import ucp_jax as ucp
    from ucp_jax.models import llama
    from ucp_jax.models.llama_train import loss_fn, make_train_step
    from ucp_jax.models.parallel import Layout
    from ucp_jax.models.placement import abstract_opt_state

    tokens = synthetic_batch(out, f32)
    cfg = llama.config_from_checkpoint(str(conv32))
    layout = Layout(fsdp=2, tensor=2)
    mesh = llama.make_mesh(layout)
    rules = llama.ucp_rules(cfg, layout)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(4.1e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))  # fmt: skip
    pt = llama.abstract_params(cfg, layout, mesh)
    params, opt_state = ucp.restore(str(conv32), pt, abstract_opt_state(optimizer, pt), rules=rules)
    batch = jax.device_put(tokens)
    with jax.default_matmul_precision("highest"):
        loss = float(jax.jit(lambda p, t: loss_fn(p, t, cfg, layout))(params, batch))
        step = make_train_step(cfg, layout, mesh, optimizer)
        params, opt_state, _ = step(params, opt_state, batch)
        loss_after = float(jax.jit(lambda p, t: loss_fn(p, t, cfg, layout))(params, batch))
    saved = out / "jax-step4"
    ucp.save(str(saved), params, opt_state, step=4, rules=rules, extra=llama.ucp_extra(cfg))
    from ucp_jax._src.cli import main as ucp_cli

    assert ucp_cli(["export", "maxtext", str(saved), str(out / "jax-export")]) == 0
    steps, res = mt.resume(out / "resume-from-jax", out / "jax-export" / "3", 3, f32, steps=6)
    return {"maxtext_to_jax": {"jax_loss": loss, "maxtext_step3_loss": full32[3],
                               "rel": abs(loss - full32[3]) / full32[3]},
            "jax_to_maxtext": {"jax_loss_after_its_step": loss_after, "maxtext_steps": steps,
                               "maxtext_losses": res, "rel": abs(res[0] - loss_after) / loss_after}}  # fmt: skip


def hf_to_maxtext(out: Path) -> dict:
    """A transformers Llama (PyTorch) -> `ucp convert hf` -> `ucp export maxtext --params-only`:
    MaxText's forward gives transformers' logits."""
    import torch
    import transformers

    from ucp_jax._src.cli import main as ucp_cli

    m = mt.MODEL
    cfg = transformers.LlamaConfig(
        vocab_size=m["vocab_size"], hidden_size=m["base_emb_dim"], intermediate_size=m["base_mlp_dim"],
        num_hidden_layers=m["base_num_decoder_layers"], num_attention_heads=m["base_num_query_heads"],
        num_key_value_heads=m["base_num_kv_heads"], head_dim=m["head_dim"], rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(out / "hf")
    assert ucp_cli(["convert", "hf", str(out / "hf"), str(out / "ucp-hf")]) == 0
    assert ucp_cli(["export", "maxtext", str(out / "ucp-hf"), str(out / "mt-hf"), "--params-only",
                    "--step-dir", "0"]) == 0  # fmt: skip
    tokens = np.random.default_rng(2).integers(0, m["vocab_size"], (2, 24)).astype(np.int32)
    np.save(out / "hf-tokens.npy", tokens)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    mt.forward(out / "mt-hf" / "0" / "items", out / "hf-tokens.npy", out / "hf-logits.npy", m)
    got = np.load(out / "hf-logits.npy")
    return {
        "max_abs_diff": float(np.abs(got - want).max()),
        "max_abs_logit": float(np.abs(want).max()),
    }


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
    cross = crossing_jax(out, conv32, full32, f32)
    a, b = cross["maxtext_to_jax"], cross["jax_to_maxtext"]
    check("crossing-maxtext-to-jax", a["rel"] <= 1e-4, **a)
    check("crossing-jax-to-maxtext", b["maxtext_steps"] == [4, 5] and b["rel"] <= 1e-4, **b)
    h = hf_to_maxtext(out)
    check("transformers-to-maxtext", h["max_abs_diff"] <= 1e-4, **h)
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
