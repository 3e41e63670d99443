"""DeepSpeed ZeRO-1/2/3 -> universal atoms, checked against DeepSpeed's own ds_to_universal, then
restored into a JAX re-implementation of the model on two meshes (loss equals torch's)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from ds import jax_tiny, tiny_model  # noqa: E402
from ds.fixtures import CASES, STEPS, ds_ckpts  # noqa: E402, F401

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main as ucp_main  # noqa: E402
from ucp_jax._src.frameworks.common.torch_arrays import to_numpy  # noqa: E402
from ucp_jax._src.frameworks.deepspeed.universal import import_deepspeed_universal  # noqa: E402
from ucp_jax._src.frameworks.deepspeed.zero import DeepSpeedFormatError, import_deepspeed  # noqa: E402
from ucp_jax._src.untrusted.unpickle import load  # noqa: E402

DIMS = dict(
    vocab=tiny_model.VOCAB,
    dim=tiny_model.DIM,
    hidden=tiny_model.HIDDEN,
    layers=tiny_model.LAYERS,
    seq=tiny_model.SEQ,
)
ADAMW = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)


def ds_universal_tensors(folder: str) -> dict[str, dict[str, np.ndarray]]:
    """Every param/slot DeepSpeed's ds_to_universal wrote, as numpy (flat ZeRO-3 ones too)."""
    zero = os.path.join(folder, "zero")
    out: dict[str, dict[str, np.ndarray]] = {}
    for name in sorted(os.listdir(zero)):
        if not os.path.isdir(os.path.join(zero, name)):
            continue
        for f in os.listdir(os.path.join(zero, name)):
            obj = load(os.path.join(zero, name, f))
            t = obj["param"] if isinstance(obj, dict) else obj
            out.setdefault(name, {})[f[:-3]] = to_numpy(t)
    return out


@pytest.fixture(scope="module")
def imported(ds_ckpts, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("imported")
    return {n: import_deepspeed(ds_ckpts.zero(n), root / n, progress=False) for n in CASES}


@pytest.mark.parametrize("name", sorted(CASES))
def test_atoms_equal_ds_to_universal(name, ds_ckpts, imported):  # noqa: F811
    """Every atom and every slot equals DeepSpeed's own conversion, bit for bit."""
    ref = ds_universal_tensors(ds_ckpts.universal(name))
    ck = ucp.open(imported[name])
    assert sorted(ck.atoms) == sorted(ref)
    n = 0
    for atom, slots in ref.items():
        info = ck.atoms[atom]
        assert {"fp32", "exp_avg", "exp_avg_sq", "step"} <= set(info.slots), atom
        for slot, want in slots.items():
            got = ck.read(atom, slot)
            assert got.dtype == want.dtype, (atom, slot)
            assert got.size == want.size and got.tobytes() == want.tobytes(), (atom, slot)
            n += 1
        assert ck.read(atom, "step") == STEPS
        assert info.shape == tuple(tiny_model.TinyGPT().get_parameter(atom).shape)
    assert n >= 3 * len(ref)
    assert ck.step == STEPS
    src = ck.manifest.source["deepspeed"]
    stage, _, dp = CASES[name]
    assert (src["zero_stage"], src["dp_degree"], src["tp_degree"]) == (stage, dp, 1)
    assert ucp_main(["verify", imported[name]]) == 0


@pytest.mark.parametrize("budget", [4 << 10, 64 << 10])
def test_small_inflight_budget_equals_ds_to_universal(budget, ds_ckpts, tmp_path):  # noqa: F811
    """Many small transactions (a budget of a few KiB, far below the default) write the same
    atoms as DeepSpeed's own conversion."""
    name = "z2_fp32_dp3"
    out = import_deepspeed(ds_ckpts.zero(name), tmp_path / "o", max_inflight_bytes=budget,
                           progress=False)  # fmt: skip
    ref = ds_universal_tensors(ds_ckpts.universal(name))
    ck = ucp.open(out)
    assert sorted(ck.atoms) == sorted(ref)
    for atom, slots in ref.items():
        for slot, want in slots.items():
            assert ck.read(atom, slot).tobytes() == want.tobytes(), (atom, slot)
    assert ucp_main(["verify", out]) == 0


def test_default_inflight_budget(monkeypatch):
    """256 MiB where the process can allocate 1 GiB, else 64 MiB; UCP_IMPORT_INFLIGHT_BYTES wins."""
    from ucp_jax._src.frameworks.deepspeed import common

    monkeypatch.delenv("UCP_IMPORT_INFLIGHT_BYTES", raising=False)
    monkeypatch.setattr(common, "allocatable", lambda: (8 << 30, "test"))
    assert common.default_inflight_bytes() == common.DEEPSPEED_INFLIGHT_BYTES == 256 << 20
    monkeypatch.setattr(common, "allocatable", lambda: None)
    assert common.default_inflight_bytes() == 256 << 20
    monkeypatch.setattr(common, "allocatable", lambda: (700 << 20, "test"))
    assert common.default_inflight_bytes() == 64 << 20
    monkeypatch.setenv("UCP_IMPORT_INFLIGHT_BYTES", str(32 << 20))
    assert common.default_inflight_bytes() == 32 << 20


def test_universal_folder_import_equals_zero_import(ds_ckpts, imported, tmp_path):  # noqa: F811
    for name in ("z1_fp32", "z3_bf16", "z2_fp32_dp3"):
        out = import_deepspeed_universal(ds_ckpts.universal(name), tmp_path / name, progress=False)
        a, b = ucp.open(out), ucp.open(imported[name])
        assert sorted(a.atoms) == sorted(b.atoms)
        for atom, info in a.atoms.items():
            assert info.shape == b.atoms[atom].shape
            assert sorted(info.slots) == sorted(b.atoms[atom].slots)
            for slot in info.slots:
                assert a.read(atom, slot).tobytes() == b.read(atom, slot).tobytes(), (atom, slot)


def torch_loss(ds_ckpts, name: str) -> float:  # noqa: F811
    """The torch model's loss on the eval batch, with DeepSpeed's own fp32 master weights."""
    ref = ds_universal_tensors(ds_ckpts.universal(name))
    m = tiny_model.TinyGPT()
    m.load_state_dict(
        {k: torch.from_numpy(ref[k]["fp32"].reshape(p.shape)) for k, p in m.named_parameters()}
    )
    with torch.no_grad():
        return float(m(tiny_model.eval_batch()))


def abstract_params():
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
        jax_tiny.shapes(**DIMS),
        is_leaf=lambda x: isinstance(x, tuple),
    )


@pytest.mark.parametrize("name", ["z1_fp32", "z2_bf16", "z3_bf16", "z2_fp32_dp3"])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (8, 1)])
def test_restore_into_jax_loss_equals_torch(name, mesh_shape, ds_ckpts, imported):  # noqa: F811
    """Restored with Stacked/Transposed rules on two meshes, the JAX loss is the torch loss."""
    mesh = ucp.make_mesh(data=mesh_shape[0], model=mesh_shape[1])
    params, _ = ucp.restore(imported[name], jax_tiny.targets(mesh, DIMS), rules=jax_tiny.RULES)
    tokens = jnp.asarray(tiny_model.eval_batch().numpy())
    got = float(jax.jit(jax_tiny.loss_fn)(params, tokens))
    want = torch_loss(ds_ckpts, name)
    assert got == pytest.approx(want, rel=2e-6, abs=2e-6)
    assert params["layers"]["qkv"]["weight"].sharding.mesh.shape == dict(
        zip(("data", "model"), mesh_shape)
    )


def jax_state(path):
    """Restore an imported checkpoint into the JAX model on a (2, 4) mesh: (optax, params, state)."""
    mesh = ucp.make_mesh(data=2, model=4)
    opt = optax.adamw(1e-2, **ADAMW)
    abstract = abstract_params()
    pt, ot = ucp.targets(
        abstract,
        mesh,
        lambda n, x: jax_tiny.spec_for(n, x.shape, mesh),
        opt_state=jax.eval_shape(opt.init, abstract),
    )
    params, state = ucp.restore(path, pt, ot, rules=jax_tiny.RULES)
    return opt, params, state


def test_restore_optax_state_count_from_step(imported):
    """mu/nu come from exp_avg/exp_avg_sq, and adamw's count from the per-atom step slots."""
    _opt, _params, state = jax_state(imported["z1_fp32"])
    adam = state[0]
    assert int(adam.count) == STEPS and adam.count.dtype == jnp.int32
    ck = ucp.open(imported["z1_fp32"])
    want = ck.read("blocks.1.fc1.weight", "exp_avg").T
    np.testing.assert_array_equal(np.asarray(adam.mu["layers"]["fc1"]["weight"][1]), want)
    want = ck.read("head.weight", "exp_avg_sq").T
    np.testing.assert_array_equal(np.asarray(adam.nu["head"]["weight"]), want)


def test_only_the_count_is_resolved_again(imported, monkeypatch):
    """The plan resolves every leaf without reading; the restore resolves again, reading the
    per-atom steps, only the leaves that take them (adamw's count), not the whole tree."""
    from ucp_jax._src import restore as restore_module

    calls = []
    real = restore_module.resolve_leaf

    def counting(ckpt, b, cast, **kw):
        calls.append(b.name)
        return real(ckpt, b, cast, **kw)

    monkeypatch.setattr(restore_module, "resolve_leaf", counting)
    _opt, _params, state = jax_state(imported["z1_fp32"])
    assert int(state[0].count) == STEPS
    assert len(calls) == 1 and calls[0].endswith("count"), calls


def test_jax_continues_like_deepspeed(imported, ds_ckpts):  # noqa: F811
    """One optax adamw step from the imported state gives DeepSpeed's next master weights."""
    opt, params, state = jax_state(imported["z1_fp32"])
    tokens = jnp.asarray(tiny_model.batch(STEPS).numpy())

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(jax_tiny.loss_fn)(p, tokens)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    params, state, loss = step(params, state)
    assert int(state[0].count) == STEPS + 1
    # the torch model from the same state, one torch AdamW step on the same batch
    ref = ds_universal_tensors(ds_ckpts.universal("z1_fp32"))
    m = tiny_model.TinyGPT()
    m.load_state_dict(
        {k: torch.from_numpy(ref[k]["fp32"].reshape(p.shape)) for k, p in m.named_parameters()}
    )
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    o.step()  # create state, then overwrite it with DeepSpeed's
    for k, p in m.named_parameters():
        o.state[p]["exp_avg"] = torch.from_numpy(ref[k]["exp_avg"].reshape(p.shape).copy())
        o.state[p]["exp_avg_sq"] = torch.from_numpy(ref[k]["exp_avg_sq"].reshape(p.shape).copy())
        o.state[p]["step"] = torch.tensor(float(STEPS))
    m.load_state_dict(
        {k: torch.from_numpy(ref[k]["fp32"].reshape(p.shape)) for k, p in m.named_parameters()}
    )
    tl = m(tiny_model.batch(STEPS))
    tl.backward()
    o.step()
    assert float(loss) == pytest.approx(float(tl.detach()), rel=1e-5)
    got = jax_tiny.from_torch_state({k: v.detach().numpy() for k, v in m.state_dict().items()})
    # Adam divides by sqrt(nu): where a gradient is ~0 (the key bias), float noise is amplified,
    # so the bound is 5% of one step (lr = 1e-2); typical differences are ~1e-7.
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=5e-4, err_msg=str(path))


def test_import_needs_no_deepspeed(ds_ckpts, tmp_path):  # noqa: F811
    """The importer runs with DeepSpeed made unimportable."""
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from ucp_jax._src.frameworks.deepspeed.zero import import_deepspeed\n"
        f"import_deepspeed({ds_ckpts.zero('z2_bf16')!r}, {str(tmp_path / 'o')!r}, progress=False)\n"
        "assert 'deepspeed' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n"
    )
    env = dict(os.environ, XLA_FLAGS="")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert ucp.open(tmp_path / "o").step == STEPS


def test_tag_and_errors(ds_ckpts, tmp_path):  # noqa: F811
    z = ds_ckpts.zero("z1_fp32")
    out = import_deepspeed(z, tmp_path / "a", tag=f"global_step{STEPS}", progress=False)
    assert ucp.open(out).manifest.source["deepspeed"]["tag"] == f"global_step{STEPS}"
    out = import_deepspeed(os.path.join(z, f"global_step{STEPS}"), tmp_path / "b", progress=False)
    assert len(ucp.open(out).atoms) == len(dict(tiny_model.TinyGPT().named_parameters()))
    with pytest.raises(ucp.NotACheckpointError, match="no tag 'nope'"):
        import_deepspeed(z, tmp_path / "c", tag="nope")
    with pytest.raises(DeepSpeedFormatError, match="import_deepspeed_universal"):
        import_deepspeed(ds_ckpts.universal("z1_fp32"), tmp_path / "d")
    with pytest.raises(FileExistsError):
        import_deepspeed(z, tmp_path / "a", progress=False)
    assert not os.path.exists(tmp_path / "c") and not os.path.exists(tmp_path / "d")
