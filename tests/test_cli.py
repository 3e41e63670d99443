"""The `ucp` command: inspect and verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ocdbt_values, save_layout

import ucp_jax as ucp
from ucp_jax._src.cli import main


def _ckpt(tmp_path, layout: str | None = None):
    params = {
        "layer": {"kernel": jnp.arange(48.0).reshape(8, 6)},
        "bias": jnp.zeros(6, jnp.bfloat16),
    }
    opt = optax.adam(1e-3).init(params)
    if layout is None:
        ucp.save(tmp_path / "ck", params, opt, step=7, extra={"run": "x"})
    else:
        save_layout(tmp_path / "ck", params, opt, step=7, layout=layout)
    return tmp_path / "ck"


def test_inspect_table(tmp_path, capsys):
    path = _ckpt(tmp_path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step 7" in out
    assert "layer.kernel" in out and "(8, 6)" in out
    assert "fp32:float32,exp_avg:float32,exp_avg_sq:float32" in out
    assert "fp32:bfloat16" in out


def test_inspect_of_an_import_names_its_source_without_question_marks(tmp_path, capsys):
    # an importer records no process or device count: nothing is printed for them
    st = pytest.importorskip("safetensors.numpy")
    st.save_file({"w": np.ones((2, 3), np.float32)}, str(tmp_path / "m.safetensors"))
    ucp.torch.import_safetensors(tmp_path / "m.safetensors", tmp_path / "ck")
    assert main(["inspect", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("source"))
    assert "?" not in line and "imported from safetensors" in line, line
    path = _ckpt(tmp_path / "own")
    assert main(["inspect", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("source"))
    assert line.endswith("1 process(es), 8 device(s)"), line


def test_inspect_json(tmp_path, capsys):
    path = _ckpt(tmp_path)
    assert main(["inspect", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["step"] == 7 and d["extra"] == {"run": "x"}
    assert d["atoms"]["layer.kernel"]["shape"] == [8, 6]
    assert d["atoms"]["layer.kernel"]["nbytes"] == 8 * 6 * 4 * 3


def test_verify_ok_and_missing_chunk(tmp_path, capsys):
    path = _ckpt(tmp_path, "per-array")  # format version 2: one file per chunk
    assert main(["verify", str(path)]) == 0
    assert "all checksums match" in capsys.readouterr().out
    chunk = next((path / "atoms" / "layer.kernel" / "exp_avg" / "c").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    chunk.unlink()
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "atom 'layer.kernel' slot 'exp_avg'" in out and "missing" in out


def test_verify_ok_and_missing_data_file(tmp_path, capsys):
    path = _ckpt(tmp_path)  # the aggregated layout: chunks live in the processes' data files
    assert main(["verify", str(path)]) == 0
    assert "all checksums match" in capsys.readouterr().out
    values = ocdbt_values(path)
    data_file = values["atoms/layer.kernel/exp_avg/c/0/0"][0]
    os.unlink(data_file)
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "atom 'layer.kernel' slot 'exp_avg'" in out and "FAIL" in out


def test_verify_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "junk").mkdir()
    assert main(["verify", str(tmp_path / "junk")]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_entry_point_runs(tmp_path):
    path = _ckpt(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "ucp_jax._src.cli", "inspect", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "layer.kernel" in r.stdout
    assert np.isfinite(len(r.stdout))


def test_file_only_commands_do_not_import_jax(tmp_path):
    """`ucp inspect`/`verify`, `ucp.open` and the importers start without JAX (~0.4 s saved)."""
    path = _ckpt(tmp_path)
    code = (
        "import sys, ucp_jax as ucp\n"
        "from ucp_jax._src.cli import main\n"
        "import ucp_jax._src.frameworks.deepspeed.zero, ucp_jax._src.frameworks.hf.safetensors\n"
        f"assert main(['inspect', {str(path)!r}]) == 0\n"
        f"assert main(['verify', {str(path)!r}]) == 0\n"
        f"assert ucp.open({str(path)!r}).read('layer.kernel')[1, 2] == 8.0\n"
        "assert 'jax' not in sys.modules, 'a file-only command imported jax'\n"
        "assert callable(ucp.save) and 'jax' in sys.modules  # JAX names load on first use\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "restore" in dir(ucp) and "memory" in dir(ucp)


def test_what_is_not_a_checkpoint_says_what_it_is(tmp_path, capsys):
    """A file, a folder of other files, an Orbax checkpoint, a missing folder: one line each,
    exit 1, saying what the path is (and, for Orbax, the command that imports it)."""
    import orbax.checkpoint as ocp

    (tmp_path / "a_file").write_text("x")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    with ocp.StandardCheckpointer() as ck:
        ck.save(tmp_path / "orbax", {"w": np.ones(4, np.float32)})
    cases = {"a_file": "a file, not a checkpoint", "plain": "holds no checkpoint",
             "orbax": "ucp convert orbax"}  # fmt: skip
    for cmd in ("inspect", "verify"):
        for name, needle in cases.items():
            capsys.readouterr()
            assert main([cmd, str(tmp_path / name)]) == 1, (cmd, name)
            out = capsys.readouterr()
            text = out.err + out.out
            assert needle in text and "Traceback" not in text, (cmd, name, text)
    for name, needle in (("a_file", "a file, not a folder"), ("missing", "no such folder")):
        capsys.readouterr()
        assert main(["ls", str(tmp_path / name)]) == 1
        assert needle in capsys.readouterr().err
    capsys.readouterr()
    assert main(["ls", str(tmp_path / "plain")]) == 0  # a folder without checkpoints: none
    assert capsys.readouterr().out == ""


def test_plan_with_a_target_that_does_not_import(tmp_path, capsys):
    path = _ckpt(tmp_path)
    for ref, needle in (("nosuchmod_xyz:f", "cannot import module"), ("os:nosuchattr", "has no")):
        capsys.readouterr()
        assert main(["plan", str(path), "--target", ref]) in (1, 2)
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and err.count("\n") == 1, err
