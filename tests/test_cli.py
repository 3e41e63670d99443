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


def _module(tmp_path, monkeypatch, name: str, source: str) -> str:
    """A module `name` in tmp_path, the working directory (as `ucp plan` imports it)."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def _one_line_user_error(capsys, argv: list[str], *needles: str) -> str:
    capsys.readouterr()
    assert main(argv) == 1, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "UCP_DEBUG" not in err and "Error:" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_plan_targets_and_rules_that_name_nothing_usable_are_user_errors(
    tmp_path, capsys, monkeypatch
):
    """A missing name, an import that fails, no function, a function returning None, rules that
    are no list: one line naming the argument, exit 1 (was `ValueError: ...`, exit 2, and a
    None target planned 0 leaves with exit 0)."""
    path = _ckpt(tmp_path)
    mod = _module(tmp_path, monkeypatch, "ucp_cli_plan_mod",
                  "def make_none():\n    return None\n\nNOTLIST = 5\n\n"
                  "def make_text():\n    return '/tmp'\n\n"
                  "def make_pair():\n    return {'w': 1.0}, {'mu': {'w': object()}}\n")  # fmt: skip
    plan = ["plan", str(path), "--target"]
    _one_line_user_error(capsys, [*plan, f"{mod}:nothere"], "--target", "has no 'nothere'",
                         "it has NOTLIST, make_none, make_pair, make_text;")  # fmt: skip
    _one_line_user_error(capsys, [*plan, "ucp_cli_no_such_mod:x"], "cannot import module")
    _one_line_user_error(capsys, [*plan, f"{mod}:NOTLIST"], "of type int, not a function")
    _one_line_user_error(capsys, [*plan, f"{mod}:make_none"], "returned None")
    # what is no tree of targets (was `TypeError: leaf '' is a str`, exit 2)
    _one_line_user_error(capsys, [*plan, f"{mod}:make_text"],
                         "returned params targets whose leaf (the whole tree) is a str")  # fmt: skip
    _one_line_user_error(capsys, [*plan, f"{mod}:make_pair"],
                         "returned opt_state targets whose leaf ['mu']['w'] is a object")  # fmt: skip
    _one_line_user_error(capsys, [*plan, f"{mod}:make_none", "--rules", f"{mod}:NOTLIST"],
                         "--rules", "of type int, not a list of rules")  # fmt: skip
    for bad in ("--target", "--rules"):  # no MODULE:NAME form: a usage error, as `--step x`
        argv = [*plan, f"{mod}:make_none", bad, mod]
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {bad}: {mod!r} is not MODULE:NAME" in err and "usage:" in err, err


def test_export_hf_max_shard_size_is_checked_as_an_argument(tmp_path, capsys):
    """`--max-shard-size banana|0|-5`: a usage error naming the accepted forms (exit 2, as any
    malformed option value), before anything is read; was `ValueError: ...` from the export."""
    from ucp_jax._src.cli.args import shard_size as _shard_size

    assert _shard_size("500MB") == 500 * 10**6 and _shard_size("2GiB") == 2 << 30
    assert _shard_size("123") == 123
    for bad in ("banana", "0", "-5"):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(["export", "hf", str(tmp_path / "none"), str(tmp_path / "out"),
                  "--max-shard-size", bad])  # fmt: skip
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --max-shard-size: {bad!r} is not a size" in err, err
        assert "5GB" in err and "500MB" in err and "UCP_DEBUG" not in err, err
    assert not (tmp_path / "out").exists()


def test_index_of_a_local_folder_is_a_user_error(tmp_path, capsys):
    _ckpt(tmp_path)
    err = _one_line_user_error(capsys, ["index", str(tmp_path)], "is a local folder",
                               f"ucp ls {tmp_path}")  # fmt: skip
    assert "ValueError" not in err


def test_ls_of_a_checkpoint_names_its_folder(tmp_path, capsys):
    """`ucp ls CKPT` (not its folder): exit 1 saying so and naming the folder to pass (printed
    nothing, exit 0); on an object store too, where `ucp index CKPT` writes nothing into it."""
    path = _ckpt(tmp_path)
    _one_line_user_error(capsys, ["ls", str(path)], "is a checkpoint itself",
                         f"(ucp ls {tmp_path})", f"ucp inspect {path}")  # fmt: skip
    assert main(["ls", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{path}\n"
    root = f"memory://ucp-cli-ls-{os.getpid()}/run"
    ucp.save(f"{root}/ck", {"a": jnp.zeros(3)}, step=1)
    for cmd in ("ls", "index"):
        _one_line_user_error(capsys, [cmd, f"{root}/ck"], "is a checkpoint itself",
                             f"(ucp {cmd} {root})")  # fmt: skip
    assert main(["index", root]) == 0 and main(["ls", root]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{root}/ck"


def test_verify_of_a_missing_path_names_it_once(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["verify", "nonexist"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {tmp_path / 'nonexist'}: ") and out.count("nonexist") == 1, out


EVIL = "w\x1b]0;TITLE\x07\x1b[2J\x00"  # retitles and clears a terminal; a NUL


def _evil_import(tmp_path):
    """A checkpoint imported from a crafted safetensors file: an atom named EVIL, one named
    `größe` (ordinary unicode), in a folder whose name holds an escape sequence too."""
    import struct

    header = {EVIL: {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "größe": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}  # fmt: skip
    h = json.dumps(header).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + bytes(16))
    dst = tmp_path / "root" / "ck\x1b[2J"
    ucp.torch.import_safetensors(tmp_path / "m.safetensors", dst)
    return dst


def _clean(text: str) -> None:
    assert all(c.isprintable() or c == "\n" for c in text), repr(text)


def test_names_from_a_checkpoint_are_printed_escaped(tmp_path, capsys, monkeypatch):
    """inspect, ls, verify and plan escape control characters of names from a checkpoint as
    repr() does (they went raw to the terminal); ordinary unicode stays readable; --json is
    escaped by JSON."""
    path = _evil_import(tmp_path)
    escaped = r"w\x1b]0;TITLE\x07\x1b[2J\x00"
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert escaped in out and "größe" in out, out
    row = next(x for x in out.splitlines() if x.startswith(escaped))
    assert "(2,)" in row and "fp32:float32" in row, row
    assert main(["inspect", str(path), "--json"]) == 0
    assert EVIL in json.loads(capsys.readouterr().out)["atoms"]
    assert main(["ls", str(tmp_path / "root")]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert out == f"{tmp_path / 'root'}/ck\\x1b[2J\n", out

    from ucp_jax._src.checkpoint import Checkpoint

    def bad_read(self, name, slot, box):  # a problem whose message quotes the name raw
        raise ucp.ChecksumError(f"chunk of {name} does not match its checksum")

    with monkeypatch.context() as m:
        m.setattr(Checkpoint, "read", bad_read)
        assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    _clean(out)
    assert f"chunk of {escaped} does not match" in out, out
    mod = _module(tmp_path, monkeypatch, "ucp_cli_plan_nothing",
                  "def nothing():\n    return {}\n")  # fmt: skip
    assert main(["plan", str(path), "--target", f"{mod}:nothing"]) == 0
    out = capsys.readouterr().out
    _clean(out)
    assert f"not read: größe, {escaped}" in out or f"not read: {escaped}, größe" in out, out
