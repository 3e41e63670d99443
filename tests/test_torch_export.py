"""export_deepspeed_universal: DeepSpeed (load_universal) resumes from our export exactly as from
its own ds_to_universal folder, also when the checkpoint was saved from JAX."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from ds import jax_tiny, tiny_model  # noqa: E402
from ds.fixtures import STEPS, TAG, ds_ckpts, torchrun  # noqa: E402, F401
from test_torch_deepspeed import ds_universal_tensors, jax_state  # noqa: E402

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.errors import ArgumentError  # noqa: E402
from ucp_jax._src.frameworks.deepspeed.export import export_deepspeed_universal  # noqa: E402
from ucp_jax._src.frameworks.deepspeed.zero import import_deepspeed  # noqa: E402
from ucp_jax._src.untrusted.unpickle import load  # noqa: E402


@pytest.fixture(scope="module")
def resumed(ds_ckpts, tmp_path_factory):  # noqa: F811
    """Exports of several kinds, and one torchrun in which DeepSpeed resumes from each."""
    root = tmp_path_factory.mktemp("export")
    jobs = {}
    for name in ("z1_fp32", "z3_bf16"):
        imp = import_deepspeed(ds_ckpts.zero(name), root / f"imp_{name}", progress=False)
        export_deepspeed_universal(imp, root / f"exp_{name}" / TAG, progress=False)
    # a JAX run: restore, save as torch-named atoms (no training), and after one adamw step
    opt, params, state = jax_state(root / "imp_z1_fp32")
    ucp.save(root / "jax_same", params, state, step=STEPS, rules=jax_tiny.RULES)
    export_deepspeed_universal(root / "jax_same", root / "exp_jax_same" / TAG, progress=False)
    tokens = jnp.asarray(tiny_model.batch(STEPS).numpy())
    loss, g = jax.value_and_grad(jax_tiny.loss_fn)(params, tokens)
    u, state = opt.update(g, state, params)
    params = optax.apply_updates(params, u)
    ucp.save(root / "jax_step", params, state, step=STEPS + 1, rules=jax_tiny.RULES)
    export_deepspeed_universal(root / "jax_step", root / "exp_jax_step" / f"global_step{STEPS + 1}",
                               progress=False)  # fmt: skip
    jobs = [
        f"ds_z1:1:fp32:{os.path.dirname(ds_ckpts.universal('z1_fp32'))}",
        f"ucp_z1:1:fp32:{root / 'exp_z1_fp32'}",
        f"jax_same:1:fp32:{root / 'exp_jax_same'}",
        f"jax_step:1:fp32:{root / 'exp_jax_step'}",
        f"ucp_z1_on_z3:3:fp32:{root / 'exp_z1_fp32'}",
        f"ds_z3:3:bf16:{os.path.dirname(ds_ckpts.universal('z3_bf16'))}",
        f"ucp_z3:3:bf16:{root / 'exp_z3_bf16'}",
    ]
    out = root / "losses.json"
    torchrun(2, ["--universal", "--steps", "2", "--result", str(out), *jobs], str(root))
    with open(out) as f:
        return root, json.load(f), float(loss)


def test_files_readable_weights_only(resumed):
    root, _, _ = resumed
    d = root / "exp_z1_fp32" / TAG
    assert (root / "exp_z1_fp32" / "latest_universal").read_text() == TAG
    for f in ("mp_rank_00_model_states.pt", "zero/optimizer_state.pt", "zero/pos/fp32.pt"):
        load(d / f)  # nothing but tensors and plain containers
    obj = torch.load(d / "zero" / "head.weight" / "fp32.pt", weights_only=True)
    assert tuple(obj["param"].shape) == (tiny_model.VOCAB, tiny_model.DIM)
    assert float(torch.load(d / "zero" / "head.weight" / "step.pt", weights_only=True)) == STEPS


def test_export_equals_ds_to_universal(resumed, ds_ckpts):  # noqa: F811
    """Every tensor of our export equals DeepSpeed's own universal folder (ZeRO-1: step too)."""
    root, _, _ = resumed
    for name in ("z1_fp32", "z3_bf16"):
        ref = ds_universal_tensors(ds_ckpts.universal(name))
        ours = ds_universal_tensors(str(root / f"exp_{name}" / TAG))
        assert sorted(ref) == sorted(ours)
        for p, slots in ref.items():
            for slot, want in slots.items():
                got = ours[p][slot]
                assert got.reshape(-1).tobytes() == want.reshape(-1).tobytes(), (name, p, slot)


def test_deepspeed_resumes_from_export_like_from_its_own(resumed):
    _, res, _ = resumed
    for r in res.values():
        assert r["start"] in (STEPS, STEPS + 1)
    assert res["ucp_z1"] == res["ds_z1"]
    assert res["ucp_z3"] == res["ds_z3"]
    # a checkpoint saved from JAX (restored from the import, not trained) resumes identically
    assert res["jax_same"] == res["ds_z1"]
    # DeepSpeed's own universal folder of a ZeRO-1 run has no ZeRO-3 model file; ours loads there
    np.testing.assert_allclose(res["ucp_z1_on_z3"]["losses"], res["ds_z1"]["losses"], rtol=1e-6)


def test_deepspeed_continues_a_jax_step(resumed):
    """JAX takes step 3, DeepSpeed resumes at 4: its loss is DeepSpeed's own loss at step 4."""
    _, res, jax_loss = resumed
    assert jax_loss == pytest.approx(res["ds_z1"]["losses"][0], rel=1e-5)
    assert res["jax_step"]["start"] == STEPS + 1
    assert res["jax_step"]["losses"][0] == pytest.approx(res["ds_z1"]["losses"][1], rel=1e-5)


@pytest.mark.parametrize("exporter", ["dcp", "deepspeed_universal", "hf", "megatron", "torchtitan"])
def test_an_export_onto_its_own_source_is_refused(tmp_path, exporter, capsys):
    # an export replaces its folder: into the checkpoint it reads (or a folder holding it) that
    # deleted the checkpoint (export_dcp(".../run/step_2", ".../run", overwrite=True) took step_1
    # and step_2); into a folder inside it, it wrote files no save wrote. Refused before writing.
    import ucp_jax.torch as ucpt

    run = tmp_path / "run"
    ucp.save(run / "step_1", {"w": np.ones((4, 4), np.float32)}, step=1)
    ucp.save(run / "step_2", {"w": np.full((4, 4), 2.0, np.float32)}, step=2)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    export = getattr(ucpt, f"export_{exporter}")
    src = str(run / "step_2")
    for dst, how in ((src, "be"), (str(run), "hold"), (os.path.join(src, "x"), "lie inside")):
        with pytest.raises(ArgumentError, match=f"would {how} the checkpoint it is exported from"):
            export(src, dst, overwrite=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    np.testing.assert_array_equal(ucp.open(src).read("w"), 2.0)
    from ucp_jax._src.cli import main

    kind = exporter.replace("_", "-")
    assert main(["export", kind, src, str(run), "--overwrite"]) == 1
    assert "would hold the checkpoint it is exported from" in capsys.readouterr().err
    assert ucp.list_checkpoints(run) == [str(run / "step_1"), src]
