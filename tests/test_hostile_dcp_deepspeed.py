"""Hostile and damaged importer inputs (issue 11), torch side: real DCP folders and DeepSpeed
checkpoints (ZeRO and universal), mutated. Each case asserts the exact error class and that it
names the file or tensor; that nothing was created anywhere in the test's folder (its tree is
unchanged); and that nothing outside the source was opened (an audit hook records every file
Python opens, and a "secret" that would import cleanly lies next to the source). Safetensors
inputs and exports: test_hostile_safetensors.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import shutil
import sys
import types
from collections.abc import Callable, Iterator

import pytest

torch = pytest.importorskip("torch")

from ds.fixtures import TAG, ds_ckpts  # noqa: E402, F401
from hostile_helpers import Box  # noqa: E402
from hostile_helpers import box as box  # noqa: E402  (the fixture)

import ucp_jax as ucp  # noqa: E402
from ucp_jax._src.errors import LimitError, UnsafePathError  # noqa: E402
from ucp_jax._src.frameworks.common.dcp_files import DCPFormatError, read_metadata  # noqa: E402
from ucp_jax._src.frameworks.dcp.read import import_dcp  # noqa: E402
from ucp_jax._src.untrusted.unpickle import STAND_INS, UnsafePickleError, load  # noqa: E402
from ucp_jax.torch import (  # noqa: E402
    DeepSpeedFormatError,
    import_deepspeed,
    import_deepspeed_universal,
)

# --------------------------------------------------------------------------------------- DCP


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory) -> str:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("dcp")
    g = torch.Generator().manual_seed(0)
    sd = {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)},
          "step": 5, "note": {"lr": 0.5}}  # fmt: skip
    with pytest.warns(UserWarning):
        dcp.save(sd, checkpoint_id=root / "d", no_dist=True)
    return str(root / "d")


def dcp_src(box: Box, dcp_folder: str) -> str:
    shutil.rmtree(box.src)
    shutil.copytree(dcp_folder, box.src)
    # the secret: a copy of the real data file outside, which would import cleanly
    for f in os.listdir(box.src):
        if f.endswith(".distcp"):
            shutil.copy(os.path.join(box.src, f), os.path.join(box.outside, f))
    return box.src


def edit_metadata(folder: str, fn: Callable[[object], None]) -> None:
    md = read_metadata(folder)
    fn(md)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def edit_storage(fqn: str, **changes: object) -> Callable[[object], None]:
    def fn(md) -> None:
        for k, info in md.storage_data.items():
            if k.fqn == fqn:
                md.storage_data[k] = dataclasses.replace(info, **changes)

    return fn


def test_dcp_unmodified_imports(box, dcp_folder):
    ck = ucp.open(import_dcp(dcp_src(box, dcp_folder), box.out, progress=False))
    assert ck.step == 5 and ck.atoms["w"].shape == (6, 4)


@pytest.mark.parametrize(
    "fqn, rel",
    [("model.w", "../outside/{f}"), ("model.w", "{abs}"), ("model.w", "x/../../outside/{f}"),
     ("model.w", "{f}\x00"), ("model.b", "/etc/passwd"), ("step", "../outside/{f}"),
     ("model.w", ""), ("model.w", 7)],
)  # fmt: skip
def test_dcp_relative_path_outside(box, dcp_folder, fqn, rel):
    src = dcp_src(box, dcp_folder)
    f = next(x for x in os.listdir(src) if x.endswith(".distcp"))
    if isinstance(rel, str):
        rel = rel.format(f=f, abs=os.path.join(box.outside, f))
    edit_metadata(src, edit_storage(fqn, relative_path=rel))
    with box.refused(UnsafePathError, "relative_path"):
        import_dcp(src, box.out, progress=False)


def test_dcp_symlinks_refused(box, dcp_folder):
    src = dcp_src(box, dcp_folder)
    f = next(x for x in os.listdir(src) if x.endswith(".distcp"))
    os.remove(os.path.join(src, f))
    os.symlink(os.path.join(box.outside, f), os.path.join(src, f))
    with box.refused(UnsafePathError, "symbolic link"):
        import_dcp(src, box.out, progress=False)
    src2 = os.path.join(box.root, "src2")
    os.makedirs(src2)
    shutil.copy(os.path.join(box.outside, f), os.path.join(src2, f))
    os.symlink(os.path.join(src, ".metadata"), os.path.join(src2, ".metadata"))
    with box.refused(UnsafePathError, "symbolic link"):
        import_dcp(src2, box.out, progress=False)


@pytest.mark.parametrize(
    "changes, match",
    [({"offset": 10**9}, "past the end"), ({"length": 10**12}, "past the end"),
     ({"offset": -8}, "non-negative integer"), ({"length": "8"}, "non-negative integer"),
     ({"length": 4}, "expected")],
)  # fmt: skip
def test_dcp_offsets_and_lengths(box, dcp_folder, changes, match):
    src = dcp_src(box, dcp_folder)
    edit_metadata(src, edit_storage("model.w", **changes))
    with box.refused(DCPFormatError, match):
        import_dcp(src, box.out, progress=False)


def _resize(fqn: str, size: list[int], chunk: list[int] | None = None) -> Callable:
    def fn(md) -> None:
        m = md.state_dict_metadata[fqn]
        m.size = torch.Size(size) if all(d >= 0 for d in size) else size
        if chunk is not None:
            m.chunks[0].sizes = chunk

    return fn


@pytest.mark.parametrize(
    "edit, exc, match",
    [(_resize("model.w", [6, -4]), DCPFormatError, "non-negative integer"),
     (_resize("model.w", [2**40, 2**40]), LimitError, "more than the limit"),
     (_resize("model.w", [6, 4], [6, 8]), DCPFormatError, "does not lie inside"),
     (_resize("model.w", [12, 4]), DCPFormatError, "its chunks hold 24 elements"),
     (lambda md: setattr(md, "storage_data", {}), DCPFormatError, "no storage entry"),
     (lambda md: md.state_dict_metadata.update({".": md.state_dict_metadata.pop("model.w")}),
      UnsafePathError, "as atom")],
)  # fmt: skip
def test_dcp_shapes_and_chunks(box, dcp_folder, edit, exc, match):
    src = dcp_src(box, dcp_folder)
    edit_metadata(src, edit)
    with box.refused(exc, match):
        import_dcp(src, box.out, progress=False)


def test_dcp_metadata_not_metadata(box, dcp_folder):
    src = dcp_src(box, dcp_folder)
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump({"state_dict_metadata": {}}, f)
    with box.refused(DCPFormatError, "expected torch's Metadata"):
        import_dcp(src, box.out, progress=False)


# --------------------------------------------------------------------------------- DeepSpeed


@contextlib.contextmanager
def deepspeed_names() -> Iterator[None]:
    """Pickle ucp's stand-ins under DeepSpeed's own names, as DeepSpeed writes them (without
    importing DeepSpeed): the mutated files are read exactly like DeepSpeed's."""
    fake: dict[str, types.ModuleType] = {}
    saved = []
    for full, cls in STAND_INS.items():
        if not full.startswith("deepspeed."):
            continue
        mod, qual = full.rsplit(".", 1)
        parts = mod.split(".")
        for i in range(1, len(parts) + 1):  # the parents too: pickle imports the top package
            fake.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        setattr(fake[mod], qual, cls)
        saved.append((cls, cls.__module__, cls.__qualname__))
        cls.__module__, cls.__qualname__ = mod, qual
    old = {m: sys.modules.get(m) for m in fake}
    sys.modules.update(fake)
    try:
        yield
    finally:
        for cls, mod, qual in saved:
            cls.__module__, cls.__qualname__ = mod, qual
        for m, v in old.items():
            if v is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = v


def resave(path: str, fn: Callable[[dict], None], big: Callable[[dict], object] | None = None,
           size: int = 10**15) -> None:  # fmt: skip
    """Load a DeepSpeed file weights-only, edit it, save it back with torch.save. `big` picks a
    tensor pickled with `size` elements over its real storage (a hostile size field)."""
    sd = load(path, mmap=False)  # not mapped: the file is overwritten below
    fn(sd)
    target = big(sd) if big else None

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            if obj is target:
                fn_, args = obj.__reduce_ex__(2)
                return fn_, (args[0], args[1], torch.Size([size]), *args[3:])
            return NotImplemented

    module = types.ModuleType("hostile_pickle")
    module.Pickler = Pickler  # type: ignore[attr-defined]
    module.Unpickler = pickle.Unpickler  # type: ignore[attr-defined]
    with deepspeed_names():
        torch.save(sd, path, pickle_module=module)


def ds_src(box: Box, ds_ckpts, name: str = "z1_fp32") -> str:  # noqa: F811
    shutil.rmtree(box.src)
    shutil.copytree(ds_ckpts.zero(name), box.src)
    shutil.copytree(ds_ckpts.zero(name), os.path.join(box.outside, "copy"))  # the secret
    return box.src


def optim(box: Box, dp: int = 0) -> str:
    return os.path.join(box.src, TAG, f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt")


def model(box: Box) -> str:
    return os.path.join(box.src, TAG, "mp_rank_00_model_states.pt")


def frag(name: str, **kw: int) -> Callable[[dict], None]:
    def fn(sd: dict) -> None:
        f = sd["optimizer_state_dict"]["param_slice_mappings"][0][name]
        for k, v in kw.items():
            setattr(f, k, v)

    return fn


def test_deepspeed_resaved_unmodified_imports(box, ds_ckpts):  # noqa: F811
    """The mutation harness itself: a file loaded and saved back imports bit-exact."""
    src = ds_src(box, ds_ckpts)
    resave(optim(box, 1), lambda sd: None)
    resave(model(box), lambda sd: None)
    ref = ucp.open(import_deepspeed(ds_ckpts.zero("z1_fp32"), box.out + "_ref", progress=False))
    ck = ucp.open(import_deepspeed(src, box.out, progress=False))
    for atom in ref.atoms:
        assert ck.read(atom, "exp_avg").tobytes() == ref.read(atom, "exp_avg").tobytes()


@pytest.mark.parametrize(
    "edit, match",
    [(frag("blocks.0.fc2.weight", start=5920 - 100), "'blocks.0.fc2.weight'"),
     (frag("blocks.0.fc2.weight", numel=10**15), "param_slice_mappings[0]['blocks.0.fc2"),
     (frag("pos", numel=10**15), "'pos' [0, 1000000000000000) overlaps 'emb.weight'"),
     (frag("pos", start=-1), "non-negative integer"),
     (frag("pos", numel=-288), "non-negative integer"),
     (frag("emb.weight", start=288.0), "non-negative integer"),
     (frag("emb.weight", start=10**18), "past the end"),
     (frag("pos", numel=300), "'pos' [0, 300) overlaps 'emb.weight'"),
     (frag("emb.weight", start=1000), "overlaps 'blocks.0.ln1.weight'"),
     (frag("pos", numel=200), "of 'pos' (fp32, TP rank 0) cover 200 of its 288"),
     (lambda sd: sd["optimizer_state_dict"].pop("param_slice_mappings"), "KeyError"),
     (lambda sd: sd["optimizer_state_dict"].update(single_partition_of_fp32_groups=[3]),
      "AttributeError")],
)  # fmt: skip
def test_deepspeed_fragments(box, ds_ckpts, edit, match):  # noqa: F811
    src = ds_src(box, ds_ckpts)
    resave(optim(box, 0), edit)
    with box.refused(DeepSpeedFormatError, match):
        import_deepspeed(src, box.out, progress=False)


def test_deepspeed_truncated_rank_file(box, ds_ckpts):  # noqa: F811
    src = ds_src(box, ds_ckpts)
    with open(optim(box, 1), "r+b") as f:
        f.truncate(os.path.getsize(optim(box, 1)) // 2)
    with box.refused(UnsafePickleError, "truncated or damaged"):
        import_deepspeed(src, box.out, progress=False)


def test_deepspeed_partition_larger_than_its_storage(box, ds_ckpts):  # noqa: F811
    """A flat partition whose size field claims 1e15 elements over a 5920-element storage."""
    src = ds_src(box, ds_ckpts)
    resave(optim(box, 1), lambda sd: None,
           big=lambda sd: sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0])  # fmt: skip
    with box.refused(LimitError, "reaches past its storage"):
        import_deepspeed(src, box.out, progress=False)


@pytest.mark.parametrize(
    "shape, exc, match",
    [([10**9], LimitError, "holds only"), ([10**15], LimitError, "more than the limit"), ([12, -24], DeepSpeedFormatError, "non-negative"),
     ([2**40, 2**40], LimitError, "more than the limit"), ("12", DeepSpeedFormatError, "shape")],
)  # fmt: skip
def test_deepspeed_param_shapes(box, ds_ckpts, shape, exc, match):  # noqa: F811
    src = ds_src(box, ds_ckpts)
    resave(model(box), lambda sd: sd["param_shapes"][0].update(pos=shape))
    with box.refused(exc, match):
        import_deepspeed(src, box.out, progress=False)


@pytest.mark.parametrize("bad", ["..", ".", ""])
def test_deepspeed_parameter_names(box, ds_ckpts, bad):  # noqa: F811
    src = ds_src(box, ds_ckpts)

    def rename(sd: dict) -> None:
        g = sd["param_shapes"][0]
        g[bad] = g.pop("pos")

    resave(model(box), rename)
    with box.refused(UnsafePathError, "as atom"):
        import_deepspeed(src, box.out, progress=False)


@pytest.mark.parametrize("tag", ["../outside/copy/" + TAG, "{abs}", f"x/../../outside/copy/{TAG}",
                                 f"{TAG}\x00", "", ".."])  # fmt: skip
def test_deepspeed_latest_outside(box, ds_ckpts, tag):  # noqa: F811
    src = ds_src(box, ds_ckpts)
    with open(os.path.join(src, "latest"), "w") as f:
        f.write(tag.format(abs=os.path.join(box.outside, "copy", TAG)))
    with box.refused(UnsafePathError, "tag"):
        import_deepspeed(src, box.out, progress=False)


def test_deepspeed_links_refused(box, ds_ckpts):  # noqa: F811
    src = ds_src(box, ds_ckpts)
    outside = os.path.join(box.outside, "copy")
    # a rank file linked to the same file outside
    os.remove(optim(box, 1))
    os.symlink(os.path.join(outside, TAG, os.path.basename(optim(box, 1))), optim(box, 1))
    with box.refused(UnsafePathError, "rank file"):
        import_deepspeed(src, box.out, progress=False)
    # the tag folder a link
    shutil.rmtree(os.path.join(src, TAG))
    os.symlink(os.path.join(outside, TAG), os.path.join(src, TAG))
    with box.refused(UnsafePathError, "symbolic link"):
        import_deepspeed(src, box.out, progress=False)
    with box.refused(UnsafePathError, "symbolic link"):
        import_deepspeed(src, box.out, tag=TAG, progress=False)
    # `latest` a link
    os.remove(os.path.join(src, "latest"))
    os.symlink(os.path.join(outside, "latest"), os.path.join(src, "latest"))
    with box.refused(UnsafePathError, "symbolic link"):
        import_deepspeed(src, box.out, progress=False)


def test_deepspeed_universal_folder(box, ds_ckpts):  # noqa: F811
    shutil.rmtree(box.src)
    shutil.copytree(os.path.dirname(ds_ckpts.universal("z1_fp32")), box.src)
    shutil.copytree(os.path.dirname(ds_ckpts.universal("z1_fp32")), box.outside + "/copy")
    tagdir, zero = os.path.join(box.src, TAG), os.path.join(box.src, TAG, "zero")
    with open(os.path.join(box.src, "latest_universal"), "w") as f:
        f.write("../outside/copy/" + TAG)
    with box.refused(UnsafePathError, "tag"):
        import_deepspeed_universal(box.src, box.out, progress=False)
    # a parameter folder linked outside
    shutil.rmtree(os.path.join(zero, "pos"))
    os.symlink(os.path.join(box.outside, "copy", TAG, "zero", "pos"), os.path.join(zero, "pos"))
    with box.refused(UnsafePathError, "symbolic link"):
        import_deepspeed_universal(tagdir, box.out, progress=False)
    # a slot file named so that its slot is '..'
    os.remove(os.path.join(zero, "pos"))
    shutil.copy(os.path.join(zero, "emb.weight", "fp32.pt"),
                os.path.join(zero, "emb.weight", "...pt"))  # fmt: skip
    with box.refused(UnsafePathError, "slot"):
        import_deepspeed_universal(tagdir, box.out, progress=False)


@pytest.mark.parametrize("slot", ["step.pt", "fp32.pt"])
def test_deepspeed_universal_expanded_tensor(box, ds_ckpts, slot):  # noqa: F811
    """A slot file holding one float expanded (stride 0) to 65536 x 65536: 16 GiB to read from
    1.5 KB; refused before anything is allocated."""
    shutil.rmtree(box.src)
    shutil.copytree(os.path.dirname(ds_ckpts.universal("z1_fp32")), box.src)
    torch.save(torch.zeros(1).expand(1 << 16, 1 << 16),
               os.path.join(box.src, TAG, "zero", "emb.weight", slot))  # fmt: skip
    with box.refused(
        LimitError, f"{slot}: a tensor of shape [65536, 65536] (stride [0, 0]) repeats"
    ):
        import_deepspeed_universal(box.src, box.out, progress=False)


def test_dcp_import_of_a_wrong_path_says_what_it_is(tmp_path):
    """A missing path, a file and a ucp checkpoint given to the DCP importer: each said as such."""
    import numpy as np

    from ucp_jax._src.frameworks.dcp.read import import_dcp

    with pytest.raises(ucp.NotACheckpointError, match="nowhere: does not exist"):
        import_dcp(tmp_path / "nowhere", tmp_path / "o1")
    (tmp_path / "w.safetensors").write_bytes(b"x")
    with pytest.raises(ucp.NotACheckpointError, match="a file: `ucp convert safetensors`"):
        import_dcp(tmp_path / "w.safetensors", tmp_path / "o2")
    ucp.save(tmp_path / "ck", {"w": np.ones(2, np.float32)})
    with pytest.raises(ucp.NotACheckpointError, match="a ucp_jax checkpoint already"):
        import_dcp(tmp_path / "ck", tmp_path / "o3")


def test_megatron_import_of_a_plain_dcp_folder_points_to_convert_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ucp_jax._src.frameworks.megatron.read import import_megatron

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    with pytest.raises(ucp.NotACheckpointError, match="`ucp convert dcp` reads it"):
        import_megatron(tmp_path / "d", tmp_path / "o")
