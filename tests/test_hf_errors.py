"""Bad Hugging Face input: each refused with a UcpError naming the file and the problem, nothing written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")
st = pytest.importorskip("safetensors.torch")

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.cli import main  # noqa: E402
from ucp_jax.models.llama_config import HFConfigError  # noqa: E402
from ucp_jax.torch import SafetensorsError, export_hf, import_hf  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97)  # fmt: skip


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama saved in several shards with an index."""
    torch.manual_seed(0)
    src = tmp_path_factory.mktemp("hf") / "llama"
    T.LlamaForCausalLM(T.LlamaConfig(**SMALL)).save_pretrained(src, max_shard_size="20KB")
    assert len(list(src.glob("*.safetensors"))) > 2
    return src


def _copy(src: Path, tmp_path: Path) -> Path:
    out = tmp_path / "src"
    shutil.copytree(src, out)
    return out


def _refused(src: Path, tmp_path: Path, error: type, *needles: str) -> None:
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(error) as e:
        import_hf(src, tmp_path / "out")
    assert isinstance(e.value, ucp.UcpError)
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, no staging left


def _edit_config(src: Path, **changes: object) -> None:
    p = src / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


def test_malformed_config_json(sharded: Path, tmp_path: Path) -> None:
    src = _copy(sharded, tmp_path)
    (src / "config.json").write_text('{"model_type": "llama", "hidden_size": 32,')
    _refused(src, tmp_path, HFConfigError, str(src / "config.json"), "not valid JSON")


def test_missing_config_json(sharded: Path, tmp_path: Path) -> None:
    src = _copy(sharded, tmp_path)
    (src / "config.json").unlink()
    _refused(src, tmp_path, HFConfigError, "config.json", "cannot read")


def test_config_field_of_wrong_type(sharded: Path, tmp_path: Path) -> None:
    src = _copy(sharded, tmp_path)
    _edit_config(src, num_attention_heads="four")
    _refused(src, tmp_path, HFConfigError, "config.json", "num_attention_heads")


def test_missing_shard(sharded: Path, tmp_path: Path) -> None:
    src = _copy(sharded, tmp_path)
    victim = sorted(src.glob("*.safetensors"))[1]
    victim.unlink()
    _refused(src, tmp_path, ucp.UcpError, victim.name)


def test_shard_of_integers_refused(sharded: Path, tmp_path: Path) -> None:
    src = _copy(sharded, tmp_path)
    victim = sorted(src.glob("*.safetensors"))[1]
    tensors = {k: v.to(torch.int16) for k, v in st.load_file(victim).items()}
    st.save_file(tensors, victim, metadata={"format": "pt"})
    _refused(src, tmp_path, ucp.UcpError, victim.name, "int16", "floating")


def test_weights_disagree_with_config(sharded: Path, tmp_path: Path) -> None:
    src = _copy(sharded, tmp_path)
    _edit_config(src, intermediate_size=64)
    _refused(src, tmp_path, ucp.MismatchError, "mlp.gate_proj.weight", "[48, 32]", "[64, 32]")


@pytest.mark.parametrize(
    ("changes", "error", "needles"),
    [
        # absurd counts: refused at once, before a name per layer or expert is listed (a billion
        # layers over 2 layers of weights grew the import to 24 GB before it was killed)
        ({"num_hidden_layers": 10**9}, HFConfigError,
         ("num_hidden_layers is 1000000000, more than any model has",)),
        ({"model_type": "mixtral", "num_local_experts": 10**6}, HFConfigError,
         ("num_local_experts is 1000000",)),
        ({"model_type": "mixtral", "num_hidden_layers": 4096, "num_local_experts": 4096},
         HFConfigError, ("num_hidden_layers x num_local_experts is 16777216",)),
        # within the bounds but more than the files hold: said with a name that is missing
        ({"num_hidden_layers": 60000}, SafetensorsError,
         ("llama with 60000 layers, at least 540000 tensors, but the files hold",
          "(no 'model.layers.59999.self_attn.q_proj.weight')")),
        ({"tie_word_embeddings": "false"}, HFConfigError,
         ("'tie_word_embeddings' must be a bool (true or false), found 'false'",)),
    ],
    ids=["layers", "experts", "layers-x-experts", "layers-not-in-files", "bool"],
)  # fmt: skip
def test_absurd_counts_are_refused_at_once(
    sharded: Path, tmp_path: Path, changes: dict, error: type, needles: tuple[str, ...]
) -> None:
    import resource
    import time

    src = _copy(sharded, tmp_path)
    _edit_config(src, **changes)
    t, rss = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _refused(src, tmp_path, error, "config.json" if error is HFConfigError else str(src), *needles)
    assert time.perf_counter() - t < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100 << 10  # KiB: < 100 MiB


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "'yarn'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1},
            "sliding-window",
        ),
    ],
    ids=["model_type", "yarn", "attention_bias", "mlp_bias", "gelu", "qwen2-window"],
)
def test_unsupported_feature(sharded: Path, tmp_path: Path, changes: dict, needle: str) -> None:
    src = _copy(sharded, tmp_path)
    _edit_config(src, **changes)
    _refused(src, tmp_path, HFConfigError, "config.json", needle)


def test_cli_convert_export_and_errors(
    sharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ck, out = tmp_path / "ck", tmp_path / "out"
    assert main(["convert", "hf", str(sharded), str(ck), "--no-progress"]) == 0
    assert (
        main(["export", "hf", str(ck), str(out), "--max-shard-size", "25KB", "--no-progress"]) == 0
    )
    files = os.listdir(out)
    n = sum(f.endswith(".safetensors") for f in files)
    assert n > 1 and "model.safetensors.index.json" in files and "config.json" in files
    _back, info = T.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    # export refuses to overwrite, and a checkpoint without a recorded config
    assert main(["export", "hf", str(ck), str(out), "--no-progress"]) == 1
    bad = tmp_path / "bad"
    shutil.copytree(sharded, bad)
    (bad / "config.json").write_text("[]")
    capsys.readouterr()
    assert main(["convert", "hf", str(bad), str(tmp_path / "ck2")]) == 1
    assert "config.json" in capsys.readouterr().err
    assert not (tmp_path / "ck2").exists()


def test_export_needs_a_config(tmp_path: Path) -> None:
    import numpy as np

    ucp.save(tmp_path / "plain", {"w": np.ones((2, 2), np.float32)})
    with pytest.raises(HFConfigError, match="hf_config"):
        export_hf(tmp_path / "plain", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.ucp-tmp").exists()
