"""Weights-only loading: allow-listed globals load, anything else is refused and nothing runs."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ucp_jax._src.untrusted.lazy import LazyTensor, load_lazy  # noqa: E402
from ucp_jax._src.untrusted.unpickle import (  # noqa: E402
    FragmentAddress,
    LossScaler,
    UnsafePickleError,
    ZeroStageEnum,
    allowed,
    load,
    loads,
    pickle_globals,
)


class _Evil:
    """Unpickling this would run a shell command that creates `marker`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvalEvil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({self.marker!r}, 'w').close()",))


def _torch_zip(obj_pickle: bytes) -> bytes:
    """A zip-format torch file whose data.pkl is `obj_pickle`."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", obj_pickle)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("evil_cls", [_Evil, _EvalEvil])
def test_malicious_pickle_runs_nothing(tmp_path, protocol, evil_cls):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    obj = {"weights": torch.zeros(3), "payload": evil_cls(str(marker))}
    torch.save(obj, path, pickle_protocol=protocol)
    with pytest.raises(UnsafePickleError) as e:
        load(path)
    assert ("system" in str(e.value)) or ("eval" in str(e.value))
    assert "allow-list" in str(e.value)
    assert not marker.exists()
    # the same, hand-made and with STACK_GLOBAL (protocol 4), through loads()
    data = _torch_zip(pickle.dumps(evil_cls(str(marker)), protocol=4))
    with pytest.raises(UnsafePickleError):
        loads(data)
    assert not marker.exists()


def test_legacy_format_malicious_refused(tmp_path):
    """Old (non-zip) torch files go through torch's weights-only unpickler, which refuses too."""
    marker = tmp_path / "pwned"
    path = tmp_path / "legacy.pt"
    torch.save({"x": _Evil(str(marker))}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafePickleError):
        load(path)
    assert not marker.exists()


def test_plain_pickle_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "plain.pkl"
    path.write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(UnsafePickleError):
        load(path)
    assert not marker.exists()


def test_scan_names_globals_without_running():
    data = pickle.dumps(_Evil("/nonexistent/x"), protocol=2)
    assert pickle_globals(data) == ["posix.system"]
    data = pickle.dumps(_Evil("/nonexistent/x"), protocol=4)
    assert pickle_globals(data) == ["posix.system"]
    assert not allowed("posix.system") and not allowed("builtins.eval")
    assert allowed("torch._utils._rebuild_tensor_v2") and allowed("collections.OrderedDict")
    assert allowed("deepspeed.utils.tensor_fragment.fragment_address")
    assert not allowed("deepspeed.runtime.engine.DeepSpeedEngine")


def test_tensors_and_containers_load(tmp_path):
    path = tmp_path / "ok.pt"
    obj = {"a": torch.arange(6.0).reshape(2, 3), "b": [torch.ones(2, dtype=torch.bfloat16)],
           "c": (1, 2.5, "x", None), "s": torch.Size([3, 4])}  # fmt: skip
    torch.save(obj, path)
    got = load(path)
    assert torch.equal(got["a"], obj["a"]) and got["b"][0].dtype == torch.bfloat16
    assert got["c"] == (1, 2.5, "x", None) and tuple(got["s"]) == (3, 4)


def test_deepspeed_stand_ins(tmp_path):
    """DeepSpeed's classes in its pickles load as data stand-ins (real classes when installed)."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler as DSLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum as DSStage
    from deepspeed.utils.tensor_fragment import fragment_address

    path = tmp_path / "ds.pt"
    torch.save({"ls": DSLossScaler(2.0), "st": DSStage.gradients,
                "fa": fragment_address(numel=5, start=7)}, path)  # fmt: skip
    got = load(path)
    assert isinstance(got["ls"], LossScaler) and got["ls"].cur_scale == 2.0
    assert got["st"] == ZeroStageEnum.gradients == 2
    assert got["fa"] == FragmentAddress(numel=5, start=7)
    # registration is scoped: torch's own weights-only load still refuses DeepSpeed's classes
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)


def test_import_ucp_jax_does_not_import_torch():
    code = "import sys, ucp_jax; assert 'torch' not in sys.modules, 'torch imported'"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]


def test_ucp_jax_torch_without_torch_says_how_to_install():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import ucp_jax.torch\nexcept ImportError as e:\n    print(e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "pip install 'ucp_jax[torch]'" in p.stdout, p.stdout + p.stderr[-2000:]


@pytest.mark.parametrize("evil_cls", [_Evil, _EvalEvil])
def test_lazy_loader_refuses_and_runs_nothing(tmp_path, evil_cls):
    """The torch-free reader used by import_deepspeed has the same gate."""
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(2), "x": evil_cls(str(marker))}, tmp_path / "e.pt")
    with pytest.raises(UnsafePickleError, match="allow-list"):
        load_lazy(tmp_path / "e.pt")
    (tmp_path / "z.pt").write_bytes(_torch_zip(pickle.dumps(evil_cls(str(marker)), protocol=4)))
    with pytest.raises(UnsafePickleError):
        load_lazy(tmp_path / "z.pt")
    assert not marker.exists()


def test_lazy_loader_reads_tensors_like_torch(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    obj = {"a": base, "nc": base[:, 1:4], "bf": torch.ones(3, dtype=torch.bfloat16),
           "p": torch.nn.Parameter(torch.full((2,), 3.0)), "s": torch.Size([2, 3]),
           "view": torch.arange(10)[2:7], "scalar": torch.tensor(3.0)}  # fmt: skip
    torch.save(obj, tmp_path / "t.pt")
    got = load_lazy(tmp_path / "t.pt")
    for k in ("a", "nc", "view", "scalar"):
        assert isinstance(got[k], LazyTensor)
        np.testing.assert_array_equal(got[k].numpy(), obj[k].numpy())
    assert got["bf"].numpy().dtype.name == "bfloat16"
    np.testing.assert_array_equal(got["p"].numpy(), [3.0, 3.0])
    assert tuple(got["s"]) == (2, 3) and got["scalar"].item() == 3.0
    np.testing.assert_array_equal(got["a"].reshape(-1).narrow(0, 5, 4).numpy(), [5, 6, 7, 8])


def test_lazy_loader_reads_float8_tensors_like_torch(tmp_path):
    """float8 tensors have no typed storage class: torch writes an untyped storage and the dtype
    (`_rebuild_tensor_v3`); offsets and strides count float8 elements."""
    g = torch.Generator().manual_seed(0)
    obj = {
        "e4m3": torch.randn(4, 6, generator=g).to(torch.float8_e4m3fn),
        "e5m2_view": torch.randn(8, generator=g).to(torch.float8_e5m2)[2:7],
        "e4m3_t": torch.randn(3, 4, generator=g).to(torch.float8_e4m3fn).t(),
        "bf": torch.randn(2, generator=g).to(torch.bfloat16),
    }
    torch.save(obj, tmp_path / "f8.pt")
    got = load_lazy(tmp_path / "f8.pt")
    for k, t in obj.items():
        a = got[k].numpy()
        assert a.dtype.name == str(t.dtype).removeprefix("torch.") and a.shape == tuple(t.shape)
        width = torch.uint8 if t.element_size() == 1 else torch.int16
        assert a.tobytes() == t.contiguous().view(width).numpy().tobytes(), k


def test_lazy_loader_refuses_a_v3_tensor_of_unknown_dtype(tmp_path):
    """A v3 rebuild of a dtype numpy cannot hold (torch.complex32) is refused, not guessed: its
    dtype global is not on the allow-list, and `_rebuild_tensor_v3` names only allowed dtypes."""
    torch.save({"c": torch.zeros(2, dtype=torch.complex32)}, tmp_path / "c.pt")
    with pytest.raises(UnsafePickleError):
        load_lazy(tmp_path / "c.pt")


def test_lazy_tensors_mapped_read_like_torch(tmp_path):
    """`mapped()` views a large contiguous tensor in the file (read-only, no copy), equal to
    torch's values, narrowed and reshaped too; the mapping ends with the array; small and
    strided tensors are read; a file cut short is refused, not mapped past its end."""
    import gc

    from ucp_jax._src.untrusted import lazy

    big = torch.arange(3 * (1 << 19), dtype=torch.float32).reshape(3, 1 << 19)  # 6 MiB
    obj = {"big": big, "small": torch.arange(10.0), "t": big[:, :1000].t()}
    path = tmp_path / "t.pt"
    torch.save(obj, path)
    got = load_lazy(path)
    m = got["big"].mapped()
    assert not m.flags.writeable and not m.flags.owndata
    np.testing.assert_array_equal(m, big.numpy())
    part = got["big"].reshape(-1).narrow(0, 12345, 1 << 18).mapped()  # not page-aligned
    np.testing.assert_array_equal(part, big.reshape(-1)[12345 : 12345 + (1 << 18)].numpy())
    assert got["small"].mapped().flags.writeable  # read into memory of its own
    np.testing.assert_array_equal(got["t"].mapped(), obj["t"].numpy())

    def mappings() -> int:
        with open("/proc/self/maps") as f:
            return sum(str(path) in line for line in f)

    if os.path.exists("/proc/self/maps"):
        assert mappings() >= 1
        del m, part
        gc.collect()
        assert mappings() == 0
    cut = tmp_path / "cut.pt"
    cut.write_bytes(path.read_bytes())
    t = got["big"]
    short = lazy.LazyTensor(str(cut), t.offset, t.dtype, t.shape, t.stride)
    os.truncate(cut, t.offset + t.nbytes - 1)
    with pytest.raises(UnsafePickleError, match="truncated"):
        short.mapped()


def test_import_deepspeed_refuses_a_poisoned_rank_file(tmp_path):
    """A DeepSpeed folder whose rank file carries a payload is refused before anything runs."""
    from ucp_jax._src.frameworks.deepspeed.zero import import_deepspeed

    marker = tmp_path / "pwned"
    ck = tmp_path / "ck" / "global_step1"
    ck.mkdir(parents=True)
    (tmp_path / "ck" / "latest").write_text("global_step1")
    torch.save({"optimizer_state_dict": {"zero_stage": 1, "x": _Evil(str(marker))}},
               ck / "zero_pp_rank_0_mp_rank_00_optim_states.pt")  # fmt: skip
    torch.save({"module": {}}, ck / "mp_rank_00_model_states.pt")
    with pytest.raises(UnsafePickleError, match="system"):
        import_deepspeed(tmp_path / "ck", tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()
