"""The referee: torchtitan 0.3.0 itself resumes from `ucp export torchtitan` (`make referees`).

torchtitan's checkpoint -> `ucp convert torchtitan` -> `ucp export torchtitan` -> torchtitan resumes
steps 3 and 4, whose losses must equal those of its uninterrupted run (tests/data/torchtitan/
records.json, relative difference <= 1e-5), on 1 process and on 2-rank FSDP. Across world sizes
(1 -> 2, 2 -> 1) the data loader's per-rank state cannot move, so both torchtitan's own checkpoint
and the export are resumed with `--checkpoint.exclude-from-loading dataloader` and their losses
must be equal. Needs torchtitan's virtualenv (tests/torchtitan/runner.py makes it with pip); runs
only with UCP_REFEREES=1, as `make referees` sets it.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not os.environ.get("UCP_REFEREES"), reason="the torchtitan referee runs in `make referees`"
)
torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "torchtitan"))

from runner import DATA, resume, workdir  # noqa: E402

from ucp_jax._src.cli import main as ucp_main  # noqa: E402

NO_DL = ["--checkpoint.exclude-from-loading", "dataloader"]
with open(os.path.join(DATA, "records.json")) as _f:
    RECORDS = json.load(_f)


def _losses(recs: list[dict]) -> list[float]:
    return [r["loss"] for r in recs]


def _close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 2, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _through_ucp(tmp_path, name: str, world_size: int | None = None) -> str:
    u, x = str(tmp_path / f"u_{name}"), str(tmp_path / f"x_{name}_{world_size}")
    src = os.path.join(DATA, name, "step-2")
    assert ucp_main(["convert", "torchtitan", src, u, "--heads", "4", "--no-progress"]) == 0
    args = ["--world-size", str(world_size)] if world_size else []
    assert ucp_main(["export", "torchtitan", u, x, *args, "--no-progress"]) == 0
    return x


@pytest.mark.parametrize("name,nproc", [("np1", 1), ("np2", 2)])
def test_torchtitan_resumes_from_export(tmp_path, name, nproc):
    root = workdir(str(tmp_path / "work"))
    got = _losses(resume(root, "ours", _through_ucp(tmp_path, name), nproc))
    want = _losses(RECORDS[name][2:])
    print(f"{name}: resumed {got}, uninterrupted {want}")
    assert _close(got, want) <= 1e-5


@pytest.mark.parametrize("name,nproc", [("np1", 2), ("np2", 1)], ids=["1to2", "2to1"])
def test_torchtitan_resumes_at_another_world_size(tmp_path, name, nproc):
    root = workdir(str(tmp_path / "work"))
    ours = _losses(resume(root, "ours", _through_ucp(tmp_path, name, nproc), nproc, NO_DL))
    own = _losses(resume(root, "own", os.path.join(DATA, name, "step-2"), nproc, NO_DL))
    print(f"{name} on {nproc}: from the export {ours}, from torchtitan's own {own}")
    assert _close(ours, own) <= 1e-5
