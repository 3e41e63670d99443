"""`ucp convert deepspeed|safetensors|dcp` and `ucp export deepspeed-universal`."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds.fixtures import TAG, ds_ckpts  # noqa: E402, F401

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main  # noqa: E402


def test_convert_and_export_deepspeed(ds_ckpts, tmp_path, capsys):  # noqa: F811
    assert main(["convert", "deepspeed", ds_ckpts.zero("z2_bf16"), str(tmp_path / "a")]) == 0
    assert "29 atoms" in capsys.readouterr().out
    # a ds_to_universal folder is recognised and imported the same
    assert main(["convert", "deepspeed", ds_ckpts.universal("z2_bf16"), str(tmp_path / "b")]) == 0
    a, b = ucp.open(tmp_path / "a"), ucp.open(tmp_path / "b")
    for atom, info in a.atoms.items():
        for slot in info.slots:
            assert a.read(atom, slot).tobytes() == b.read(atom, slot).tobytes()
    assert main(["verify", str(tmp_path / "a")]) == 0
    dst = tmp_path / "ds" / TAG
    assert main(["export", "deepspeed-universal", str(tmp_path / "a"), str(dst)]) == 0
    assert (tmp_path / "ds" / "latest_universal").read_text() == TAG
    assert os.path.isfile(dst / "zero" / "emb.weight" / "exp_avg_sq.pt")
    assert main(["export", "deepspeed-universal", str(tmp_path / "a"), str(dst)]) == 1
    assert "exists" in capsys.readouterr().err


def test_convert_errors_are_one_line(tmp_path, capsys):
    assert main(["convert", "deepspeed", str(tmp_path), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ucp convert:") and "no ZeRO optimizer files" in err


def test_convert_safetensors_and_dcp(tmp_path, capsys):
    st = pytest.importorskip("safetensors.torch")
    st.save_file({"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "m.safetensors")
    assert (
        main(["convert", "safetensors", str(tmp_path / "m.safetensors"), str(tmp_path / "s")]) == 0
    )
    assert ", no step, in " in capsys.readouterr().out  # (it printed "step None")
    np.testing.assert_array_equal(ucp.open(tmp_path / "s").read("w"), np.arange(6.0).reshape(2, 3))
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):
        dcp.save({"model": {"w": torch.ones(4)}}, checkpoint_id=tmp_path / "d", no_dist=True)
    assert main(["convert", "dcp", str(tmp_path / "d"), str(tmp_path / "u")]) == 0
    np.testing.assert_array_equal(ucp.open(tmp_path / "u").read("w"), np.ones(4))


@pytest.mark.parametrize("kind", ["hf", "safetensors", "dcp", "deepspeed", "megatron"])
def test_a_convert_from_a_url_or_a_file_in_the_folder_says_what_to_pass(tmp_path, capsys, kind):
    """A foreign source is a local folder: a URL said 'no such file', and a model folder's
    config.json given for the folder said '.../config.json/config.json: Not a directory'."""
    assert main(["convert", kind, "gs://bucket/model", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "gs://bucket/model: the " in err and "copy it from the store first" in err, err
    if kind == "hf":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text("{}")
        assert (
            main(["convert", "hf", str(tmp_path / "m" / "config.json"), str(tmp_path / "o")]) == 1
        )
        err = capsys.readouterr().err
        assert (
            f"pass the model folder holding config.json and the weights ({tmp_path / 'm'})" in err
        )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["hf", "deepspeed-universal", "dcp", "megatron", "torchtitan"])
@pytest.mark.parametrize("url", ["s3://bucket/out", "gs://bucket/out"])
def test_an_export_to_a_url_is_refused_not_written_to_a_folder_named_s3(tmp_path, capsys,
                                                                         monkeypatch, kind, url):  # fmt: skip
    # Exporters write through the filesystem: an s3:// destination became ./s3:/bucket/out, and
    # the export reported success with nothing in the bucket. Now: one line naming the fix.
    monkeypatch.chdir(tmp_path)
    ucp.save(tmp_path / "ck", {"w": np.ones((4, 4), np.float32)}, step=1)
    assert main(["export", kind, str(tmp_path / "ck"), url]) == 1
    err = capsys.readouterr().err
    assert f"{url}: " in err and "write it locally and copy it to the store" in err, err
    assert sorted(os.listdir(tmp_path)) == ["ck"]
