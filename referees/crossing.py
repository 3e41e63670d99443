"""The crossing: torchtitan -> ucp -> MaxText, and MaxText -> ucp -> torchtitan (make referees).

    python referees/crossing.py [OUT]      (default $REF_DIR/ucp-crossing)

Needs both referee environments: torchtitan's venv (tests/torchtitan/runner.py) and MaxText's
(referees/maxtext/setup.sh). Both trainers run the same Llama (dim 32, 4 heads in 2 KV groups,
head_dim 8, FFN 96, 2 layers, vocabulary 2048, RMSNorm eps 1e-5, RoPE theta 500000 with Llama 3
scaling: torchtitan's `llama3_ucp_tiny`, MaxText's `rope_type=llama3.1`), in float32, on one fixed
batch: MaxText's synthetic batch (randint of PRNGKey(0), [1, 65]), which torchtitan is given as
every step's batch (`UCP_TT_TOKENS`).

1. torchtitan -> MaxText: torchtitan trains 3 steps (checkpoint after step 2, weights and AdamW
   state); `ucp convert torchtitan` -> `ucp export maxtext --rope llama3.1`; MaxText resumes (its
   folder 1: after 2 updates) and its first loss must equal torchtitan's step-3 loss.
2. MaxText -> torchtitan: MaxText trains 4 steps (checkpoint folder 2: after 3 updates);
   `ucp convert maxtext --rope llama3.1` -> `ucp export torchtitan`; torchtitan resumes at step-3
   and its first loss (step 4) must equal MaxText's 4th loss.

Both relative differences must be <= 1e-4. The moments are checked too, read by the trainers'
own libraries (torch DCP, Orbax) on both sides of each crossing: the source's AdamW/Adam state
and what the target resumes from, mapped by hand (tt_moments), agree within 1e-6 relative, and
Adam's count equals torch's per-parameter step. The optimizers' hyperparameters are the user's to match:
MaxText is set to torchtitan's AdamW (lr 8e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1,
clipping 1.0); the schedules (warmup) differ, so only the first loss after a crossing is compared.
A JSON report goes to OUT/report.json; exit status 1 if a check fails.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "referees" / "maxtext"))
sys.path.insert(0, str(ROOT / "tests" / "torchtitan"))
import mt  # noqa: E402
import runner as tt  # noqa: E402
from referee import synthetic_batch  # noqa: E402

from ucp_jax._src.cli import main as ucp  # noqa: E402

RTOL = 1e-4
# torchtitan's tiny Llama (tests/torchtitan/tt_train.py) as MaxText spells it
MODEL = {
    "base_emb_dim": 32, "base_num_query_heads": 4, "base_num_kv_heads": 2, "base_mlp_dim": 96,
    "base_num_decoder_layers": 2, "head_dim": 8, "vocab_size": 2048, "max_target_length": 64,
    "normalization_layer_epsilon": 1e-5, "rope_type": "llama3.1", "rope_max_timescale": 500000,
    "dtype": "float32", "matmul_precision": "highest",
}  # fmt: skip
# torchtitan's AdamW of llama3_debugmodel, as far as MaxText's adamw has it
ADAM = {"learning_rate": 8e-4, "adam_b1": 0.9, "adam_b2": 0.95, "adam_eps": 1e-8,
        "adam_weight_decay": 0.1, "gradient_clipping_threshold": 1.0}  # fmt: skip
TT_FP32 = ["--training.mixed-precision-param", "float32"]
CONV = ["--heads", "4", "--norm-eps", "1e-5", "--rope-theta", "500000", "--no-progress"]


def tt_args(steps: int, tokens: np.ndarray) -> list[str]:
    """torchtitan's referee flags with this run's steps, batch size and length."""
    args, out = list(tt.ARGS), []
    over = {"--training.steps": str(steps), "--training.local-batch-size": str(tokens.shape[0]),
            "--training.seq-len": str(tokens.shape[1] - 1)}  # fmt: skip
    i = 0
    while i < len(args):
        if args[i] in over:
            out += [args[i], over[args[i]]]
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def tt_run(root: str, dump: str, steps: int, tokens_file: Path, tokens: np.ndarray,
           resume_from: Path | None = None, resume_step: int = 0) -> list[dict]:  # fmt: skip
    tt.ARGS = tt_args(steps, tokens)
    env = {"UCP_TT_FIXED": os.path.join(root, dump + "-fixed"), "UCP_TT_TOKENS": str(tokens_file)}
    d = os.path.join(root, dump)
    shutil.rmtree(d, ignore_errors=True)
    if resume_from is not None:
        os.makedirs(os.path.join(d, "checkpoint"))
        shutil.copytree(resume_from, os.path.join(d, "checkpoint", f"step-{resume_step}"))
    # a checkpoint from MaxText has no data loader state (the batches are fixed anyway)
    no_dl = ["--checkpoint.exclude-from-loading", "dataloader"] if resume_from else []
    return tt.train(root, dump, 1, [*TT_FP32, *no_dl], env)


def tt_moments(step_dir: Path, tmp: Path) -> tuple[dict[str, np.ndarray], int]:
    """torchtitan's AdamW moments (a DCP step folder, read by torch) in MaxText's layout: the
    fused `wqkv` [kv groups, q heads of the group + k + v, hd, dim] split and transposed, the
    query's `exp_avg` times sqrt(hd) and `exp_avg_sq` times hd (MaxText's query kernel is
    torchtitan's / sqrt(hd), so its gradient is sqrt(hd) times torchtitan's); and the step."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(tmp))
    sd = torch.load(tmp, weights_only=False)  # nested by torchtitan's own planner data, else flat
    opt = {f"optimizer.{k}": v for k, v in sd.get("optimizer", {}).items()} or sd
    h, kv, hd, d = 4, 2, 8, 32
    out: dict[str, np.ndarray] = {}
    for ts, ms, f in (("exp_avg", "mu", hd**0.5), ("exp_avg_sq", "nu", hd)):

        def g(n: str, ts: str = ts) -> np.ndarray:
            return opt[f"optimizer.state.{n}.{ts}"].float().numpy()

        out[f"{ms}.embed"] = g("tok_embeddings.weight")
        out[f"{ms}.logits"] = g("lm_head.weight").T
        out[f"{ms}.norm"] = g("norm.weight")
        for i in range(2):
            p = f"layers.{i}."
            qkv = g(p + "attention.qkv_linear.wqkv.weight").reshape(kv, h // kv + 2, hd, d)
            out[f"{ms}.{i}.query"] = qkv[:, :-2].reshape(h * hd, d).T.reshape(d, h, hd) * f
            out[f"{ms}.{i}.key"] = qkv[:, -2].reshape(kv * hd, d).T.reshape(d, kv, hd)
            out[f"{ms}.{i}.value"] = qkv[:, -1].reshape(kv * hd, d).T.reshape(d, kv, hd)
            out[f"{ms}.{i}.out"] = g(p + "attention.wo.weight").T.reshape(h, hd, d)
            out[f"{ms}.{i}.wi_0"] = g(p + "feed_forward.w1.weight").T
            out[f"{ms}.{i}.wi_1"] = g(p + "feed_forward.w3.weight").T
            out[f"{ms}.{i}.wo"] = g(p + "feed_forward.w2.weight").T
            out[f"{ms}.{i}.ln1"] = g(p + "attention_norm.weight")
            out[f"{ms}.{i}.ln2"] = g(p + "ffn_norm.weight")
    steps = {
        int(v) for k, v in opt.items() if k.startswith("optimizer.state.") and k.endswith(".step")
    }
    assert len(steps) == 1, steps
    return out, steps.pop()


def mt_moments(items: Path) -> tuple[dict[str, np.ndarray], int]:
    """MaxText's Adam moments (an `items` folder, read by Orbax) by the names of `tt_moments`;
    and Adam's count."""
    import orbax.checkpoint as ocp

    t = ocp.PyTreeCheckpointer().restore(str(items))
    out: dict[str, np.ndarray] = {}
    for ms in ("mu", "nu"):
        dec = t["opt_state"][0][ms]["params"]["decoder"]
        lay, att, mlp = dec["layers"], dec["layers"]["self_attention"], dec["layers"]["mlp"]
        out[f"{ms}.embed"] = t["opt_state"][0][ms]["params"]["token_embedder"]["embedding"]
        out[f"{ms}.logits"] = dec["logits_dense"]["kernel"]
        out[f"{ms}.norm"] = dec["decoder_norm"]["scale"]
        for i in range(2):
            for n in ("query", "key", "value", "out"):
                out[f"{ms}.{i}.{n}"] = att[n]["kernel"][:, i]
            for n in ("wi_0", "wi_1", "wo"):
                out[f"{ms}.{i}.{n}"] = mlp[n]["kernel"][:, i]
            out[f"{ms}.{i}.ln1"] = lay["pre_self_attention_layer_norm"]["scale"][:, i]
            out[f"{ms}.{i}.ln2"] = lay["post_self_attention_layer_norm"]["scale"][:, i]
    return {k: np.asarray(v) for k, v in out.items()}, int(t["opt_state"][0]["count"])


def moments_rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """The largest max |a - b| / max |b| over the moments (inf if the names or shapes differ)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    return max(float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()) for k in a)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else mt.REF_DIR / "ucp-crossing"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.time()
    tokens = synthetic_batch(out, MODEL)
    tokens_file = out / "batch.npy"
    np.save(tokens_file, tokens)
    root = tt.workdir(str(out / "tt-work"))
    report: dict[str, object] = {"batch_shape": list(tokens.shape), "maxtext_adam": ADAM}
    ok = True

    # 1. torchtitan -> MaxText
    src = tt_run(root, "tt", 3, tokens_file, tokens)
    tt_losses = [r["loss"] for r in src]
    u1, x1 = out / "u-from-tt", out / "mt-from-tt"
    step2 = Path(root) / "tt" / "checkpoint" / "step-2"
    assert ucp(["convert", "torchtitan", str(step2), str(u1), *CONV]) == 0
    assert ucp(["export", "maxtext", str(u1), str(x1), "--rope", "llama3.1", "--no-progress"]) == 0
    steps, res = mt.resume(out / "mt-resume", x1 / "1", 1, {**MODEL, **ADAM}, steps=4)
    a = {"torchtitan_losses": tt_losses, "maxtext_steps": steps, "maxtext_losses": res,
         "first_loss_after": res[0], "source_loss": tt_losses[2],
         "rel": rel(res[0], tt_losses[2])}  # fmt: skip
    got, count = mt_moments(x1 / "1" / "items")
    want, tstep = tt_moments(step2, out / "tt-step2.pt")
    a.update(moments_rel=moments_rel(got, want), adam_count=count, torch_step=tstep)
    passed = steps[:1] == [2] and a["rel"] <= RTOL and a["moments_rel"] <= 1e-6 and count == tstep
    ok = ok and passed
    report["torchtitan_to_maxtext"] = {"pass": passed, **a}
    print("torchtitan_to_maxtext", "PASS" if passed else "FAIL", json.dumps(a))

    # 2. MaxText -> torchtitan
    full = mt.train(out / "mt", {**MODEL, **ADAM}, steps=4)
    u2, x2 = out / "u-from-mt", out / "tt-from-mt" / "step-3"
    assert ucp(["convert", "maxtext", str(out / "mt" / "x" / "checkpoints" / "2"), str(u2),
                "--rope", "llama3.1", "--rope-theta", "500000", "--norm-eps", "1e-5"]) == 0  # fmt: skip
    assert ucp(["export", "torchtitan", str(u2), str(x2), "--lr", "8e-4", "--no-progress"]) == 0
    recs = tt_run(root, "tt-resume", 5, tokens_file, tokens, x2, 3)
    b = {"maxtext_losses": full, "torchtitan_steps": [r["step"] for r in recs],
         "torchtitan_losses": [r["loss"] for r in recs], "first_loss_after": recs[0]["loss"],
         "source_loss": full[3], "rel": rel(recs[0]["loss"], full[3])}  # fmt: skip
    got, tstep = tt_moments(x2, out / "tt-export.pt")
    want, count = mt_moments(out / "mt" / "x" / "checkpoints" / "2" / "items")
    b.update(moments_rel=moments_rel(got, want), adam_count=count, torch_step=tstep)
    passed = (b["torchtitan_steps"][:1] == [4] and b["rel"] <= RTOL and b["moments_rel"] <= 1e-6
              and count == tstep)  # fmt: skip
    ok = ok and passed
    report["maxtext_to_torchtitan"] = {"pass": passed, **b}
    print("maxtext_to_torchtitan", "PASS" if passed else "FAIL", json.dumps(b))

    report["seconds"] = round(time.time() - t0, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print("report:", out / "report.json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
