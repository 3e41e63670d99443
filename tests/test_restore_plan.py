"""`ucp.plan`: every problem of a restore, found from the manifest alone (no array read).

A renamed module, a missing leaf and a shape mismatch are reported together, with the closest
unread atoms and a rule that maps the renamed module; `restore` raises the same report as one
error, before it reads anything; the suggested rule makes the restore go through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_of, need_devices, place, targets

import ucp_jax as ucp
from ucp_jax._src.format import store


def _state() -> dict:
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((32, 8), dtype=np.float32),
        "encoder": {
            "dense": {
                "kernel": rng.standard_normal((8, 16), dtype=np.float32),
                "bias": np.zeros(16, np.float32),
            }
        },
        "head": rng.standard_normal((16, 4), dtype=np.float32),
    }


def _refuse_opens(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """From now on, fail on any array open: a plan reads the manifest only."""
    opened: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        opened.append(args)
        raise AssertionError("an array was opened")

    monkeypatch.setattr(store, "open_array_async", refuse)
    monkeypatch.setattr(store, "open_array", refuse)
    return opened


def _changed(mesh: jax.sharding.Mesh) -> dict:
    """The model after a refactor: encoder.dense -> encoder.linear, a new layer, a wider head."""
    s = _state()
    s["encoder"] = {"linear": s["encoder"].pop("dense")}
    s["new_layer"] = np.zeros((4, 4), np.float32)
    s["head"] = np.zeros((16, 8), np.float32)
    return targets(s, mesh)


def test_plan_reports_everything_and_reads_nothing(tmp_path, monkeypatch):
    need_devices(8)  # its layout or its counts of shards are those of 8 devices
    a, b = mesh_of((2, 4)), mesh_of((4, 2))
    ucp.save(tmp_path / "ck", place(_state(), a), step=3)
    no_reads = _refuse_opens(monkeypatch)
    before = ucp.last_read_stats()
    report = ucp.plan(tmp_path / "ck", _changed(b))
    assert not no_reads and ucp.last_read_stats() is before
    assert not report.ok
    kinds = {p.leaf: p.kind for p in report.problems}
    assert kinds == {
        "encoder.linear.kernel": "missing",
        "encoder.linear.bias": "missing",
        "new_layer": "missing",
        "head": "shape",
    }
    assert report.matched == ["embed"]
    assert report.unexpected == ["encoder.dense.bias", "encoder.dense.kernel", "head"]
    by_leaf = {p.leaf: p for p in report.problems}
    assert by_leaf["encoder.linear.kernel"].close[0] == "encoder.dense.kernel"
    assert by_leaf["new_layer"].close == ()
    assert report.suggested_rules == [(r"encoder\.linear\.(.*)", ucp.Renamed(r"encoder.dense.\1"))]
    text = str(report)
    for needle in ("encoder.linear.kernel", "new_layer", "head", "(16, 8)", "Renamed"):
        assert needle in text, needle
    # what a restore of the matching leaves reads: embed (32x8 f32), in 4x2 distinct shards
    assert report.bytes_per_process == {0: 32 * 8 * 4}
    assert report.reads == 8 and report.peak_host_bytes >= 32 * 8 * 4

    # restore raises the same report, one error listing every problem, having read nothing
    with pytest.raises(ucp.RestorePlanError) as info:
        ucp.restore(tmp_path / "ck", _changed(b))
    assert not no_reads
    msg = str(info.value)
    assert all(n in msg for n in ("encoder.linear.bias", "new_layer", "head"))
    assert isinstance(info.value, ucp.MismatchError) and isinstance(info.value, ucp.PatternError)
    assert info.value.plan.problems == report.problems


def test_suggested_rule_restores_the_renamed_module(tmp_path):
    a, b = mesh_of((2, 4)), mesh_of((4, 2))
    state = _state()
    ucp.save(tmp_path / "ck", place(state, a))
    want = _state()
    want["encoder"] = {"linear": want["encoder"].pop("dense")}
    target = targets(want, b)
    report = ucp.plan(tmp_path / "ck", target)
    assert [p.leaf for p in report.missing] == ["encoder.linear.bias", "encoder.linear.kernel"]
    got, _ = ucp.restore(tmp_path / "ck", target, rules=report.suggested_rules)
    np.testing.assert_array_equal(got["encoder"]["linear"]["kernel"],
                                  state["encoder"]["dense"]["kernel"])  # fmt: skip
    assert ucp.plan(tmp_path / "ck", target, rules=report.suggested_rules).ok


def test_plan_with_optimizer_state_dtype_and_rules(tmp_path, monkeypatch):
    import optax

    mesh = mesh_of((8,))
    params = place({"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}, mesh)
    opt = optax.adam(1e-3).init(params)
    ucp.save(tmp_path / "ck", params, opt)
    no_reads = _refuse_opens(monkeypatch)
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.ndim else x, params)
    p_t = targets(half, mesh)
    report = ucp.plan(tmp_path / "ck", p_t, targets(optax.adam(1e-3).init(half), mesh),
                      rules=[(r"nothing\.matches", ucp.Replicated())])  # fmt: skip
    kinds = sorted((p.kind, p.leaf) for p in report.problems)
    assert ("rule", "") in kinds and ("dtype", "w") in kinds and ("dtype", "b") in kinds
    assert ("dtype", "opt_state.0.mu.w") in kinds
    assert ucp.plan(tmp_path / "ck", p_t, cast=True).ok  # params only, cast: fine
    assert ucp.plan(tmp_path / "ck", p_t, cast=True).unexpected == ["opt_state.0.count"]
    assert not no_reads
    monkeypatch.undo()
    got, _ = ucp.restore(tmp_path / "ck", p_t, cast=True)
    assert got["w"].dtype == jnp.bfloat16


def test_cli_plan(tmp_path, monkeypatch, capsys):
    from ucp_jax._src.cli import main

    ucp.save(tmp_path / "ck", place(_state(), mesh_of((2, 4))))
    (tmp_path / "plan_targets.py").write_text(
        "import numpy as np\n"
        "from helpers import mesh_of, targets\n"
        "def good():\n"
        "    from test_restore_plan import _state\n"
        "    return targets(_state(), mesh_of((4, 2)))\n"
        "def bad():\n"
        "    from test_restore_plan import _changed\n"
        "    return _changed(mesh_of((4, 2))), None\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(tmp_path / "ck"), "--target", "plan_targets:good"]) == 0
    assert "4 leaves match, 0 problem(s)" in capsys.readouterr().out
    assert main(["plan", str(tmp_path / "ck"), "--target", "plan_targets:bad"]) == 1
    out = capsys.readouterr().out
    assert "[missing]" in out and "Renamed" in out and "[shape]" in out
