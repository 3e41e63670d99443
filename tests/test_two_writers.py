"""Two writers, one path: two jobs saving the same step to the same folder (or bucket path) at once,
and a save racing a restore of the checkpoint it replaces.

Real processes (`mp/race_worker.py`), started together round after round: in every round one save
wins whole and the other gets a clear error (`WriterConflictError`, or `DestinationExistsError`
when it came after the winner's commit); the committed checkpoint holds one job's values only, never a
mix. A restore racing overwrites of the same path gets the old values or the new, bit-exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from mp.race_worker import state
from mp.runner import worker_env
from test_object_stores import BUCKET, s3  # noqa: F401 - the moto server fixture

import ucp_jax as ucp
from ucp_jax._src.format import commit

WORKER = Path(__file__).parent / "mp" / "race_worker.py"
CLEAR = {"WriterConflictError", "DestinationExistsError"}  # (the latter a FileExistsError)


def _race(root: str, sync: Path, rounds: int, overwrite: bool = False) -> list[dict[int, dict]]:
    """Two jobs (1 and 2) save to root/step_<r> together, for each round r; their reports."""
    sync.mkdir(parents=True, exist_ok=True)
    env = worker_env(2, UCP_WRITER_CLAIM_S="2")
    argv = [[sys.executable, str(WORKER), "save", str(job), root, str(rounds), str(sync),
             "1" if overwrite else "0"] for job in (1, 2)]  # fmt: skip
    procs = [subprocess.Popen(a, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a in argv]  # fmt: skip
    reports: list[dict[int, dict]] = []
    try:
        for r in range(rounds):
            (sync / f"go_{r}").touch()
            deadline = time.monotonic() + 120
            files = [sync / f"{job}_{r}.json" for job in (1, 2)]
            while not all(f.exists() for f in files):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    outs = [p.communicate(timeout=5) if p.poll() is not None else ("", "")
                            for p in procs]  # fmt: skip
                    pytest.fail(f"the jobs did not report round {r}: {outs}")
                time.sleep(0.01)
            time.sleep(0.02)  # the report is written whole before the next look
            reports.append({job: json.loads(f.read_text()) for job, f in zip((1, 2), files)})
    finally:
        for p in procs:
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
    return reports


def _judge(path: str, report: dict[int, dict], counts: Counter[str]) -> None:
    """One save won (its values are the checkpoint's, whole), the other got a clear error."""
    ok = [job for job, rep in report.items() if rep["outcome"] == "ok"]
    for rep in report.values():
        assert rep["outcome"] == "ok" or rep["outcome"] in CLEAR, rep
        if rep["outcome"] == "WriterConflictError":
            assert "another save to this checkpoint" in rep["message"], rep
    counts["+".join(sorted(rep["outcome"] for rep in report.values()))] += 1
    r = int(path.rsplit("_", 1)[1])
    c = ucp.open(path)
    got = {name: c.read(name) for name in ("w", "v")}
    winners = [job for job in (1, 2)
               if all(np.array_equal(got[n], state(job, r)[n]) for n in got)]  # fmt: skip
    assert winners, f"round {r}: the checkpoint holds a mix of both jobs' values"
    assert len(ok) >= 1 and (len(ok) == 1 or winners[0] in ok), report
    if len(ok) == 1:
        assert winners == ok, (winners, report)


def test_two_jobs_save_one_step_to_one_folder(tmp_path: Path) -> None:
    root = tmp_path / "run"
    counts: Counter[str] = Counter()
    for overwrite, rounds in ((False, 4), (True, 3)):
        reports = _race(str(root / f"o{int(overwrite)}"), tmp_path / f"sync{int(overwrite)}",
                        rounds, overwrite)  # fmt: skip
        for r, rep in enumerate(reports):
            _judge(str(root / f"o{int(overwrite)}" / f"step_{r}"), rep, counts)
        names = os.listdir(root / f"o{int(overwrite)}")
        assert sorted(names) == [f"step_{r}" for r in range(rounds)], names  # nothing left over
    print(f"\ntwo jobs, one folder (outcomes): {dict(counts)}")
    assert counts["WriterConflictError+ok"] >= 1  # the race happened, and was refused


def test_two_jobs_save_one_step_to_one_bucket_path(s3) -> None:  # noqa: F811
    import tempfile

    counts: Counter[str] = Counter()
    root = f"s3://{BUCKET}/race"
    with tempfile.TemporaryDirectory() as sync:
        reports = _race(root, Path(sync), 3)
    for r, rep in enumerate(reports):
        try:
            _judge(f"{root}/step_{r}", rep, counts)
        except ucp.ChecksumError as e:  # the loser's last writes refused, never returned
            counts[f"refused: {type(e).__name__}"] += 1
    print(f"\ntwo jobs, one bucket path (outcomes): {dict(counts)}")
    assert counts["WriterConflictError+ok"] >= 1


def test_a_second_writer_touches_nothing_of_the_first(tmp_path: Path, monkeypatch) -> None:
    """In one process, deterministically: while a save holds the path, another is refused at
    once and the first one commits whole."""
    started, release = threading.Event(), threading.Event()
    seal = commit.seal

    def held(*a, **k):  # type: ignore[no-untyped-def]
        started.set()
        release.wait(30)
        return seal(*a, **k)

    monkeypatch.setattr(commit, "seal", held)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            ucp.save(tmp_path / "step_1", state(1, 1), step=1)
        except BaseException as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(30)
    monkeypatch.setattr(commit, "seal", seal)
    with pytest.raises(ucp.WriterConflictError, match=r"pid \d+ on .* holds .*step_1.ucp-lock"):
        ucp.save(tmp_path / "step_1", state(2, 1), step=1, overwrite=True)
    release.set()
    t.join(60)
    assert not errors, errors
    assert np.array_equal(ucp.open(tmp_path / "step_1").read("w"), state(1, 1)["w"])
    assert sorted(os.listdir(tmp_path)) == ["step_1"]


def test_a_killed_saves_leftovers_are_swept(tmp_path: Path) -> None:
    """A save killed midway leaves its staging folder (and lock file); the next save into the same
    folder removes them, as nobody holds their lock; a save in progress is left alone."""
    (tmp_path / ".step_1.ucp-tmp" / "atoms").mkdir(parents=True)
    (tmp_path / ".step_1.ucp-lock").write_text("pid 1 on gone")
    (tmp_path / ".step_0.ucp-old-12ab").mkdir()
    ucp.save(tmp_path / "step_2", state(1, 2), step=2)
    assert sorted(os.listdir(tmp_path)) == ["step_2"]


def test_restore_racing_overwrites_sees_old_or_new(tmp_path: Path, caplog) -> None:
    dest, stop = tmp_path / "ck", tmp_path / "stop"
    ucp.save(dest, state(1, 0), step=0)
    writer = subprocess.Popen([sys.executable, str(WORKER), "overwrite", str(dest), str(stop)],
                              env=worker_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
    want = {1: state(1, 0), 2: state(2, 0)}
    counts: Counter[str] = Counter()
    count = tmp_path / "stop.count"

    def saves() -> int:
        return int(count.read_text() or 0) if count.exists() else 0

    try:
        deadline = time.monotonic() + 90
        while saves() < 1 and time.monotonic() < deadline and writer.poll() is None:
            time.sleep(0.05)
        first = saves()
        while time.monotonic() < deadline and (sum(counts.values()) < 30 or saves() < first + 10):
            try:
                got, _ = ucp.restore(dest, want[1])
            except ucp.ChecksumError as e:  # read again, and replaced again, every time
                assert "was replaced while it was read" in str(e), e
                counts["replaced each time it was read"] += 1
                continue
            which = [k for k, v in want.items()
                     if all(np.array_equal(got[n], v[n]) for n in v)]  # fmt: skip
            assert which, "a restore returned a mix of two saves"
            counts[f"values of save {which[0]}"] += 1
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    again = caplog.text.count("was replaced while it was read")
    print(f"\nrestore racing {out.strip()} overwrites (outcomes): {dict(counts)}; read again: "
          f"{again}")  # fmt: skip
    assert sum(v for k, v in counts.items() if k.startswith("values")) >= 20
    assert counts["values of save 1"] and counts["values of save 2"]  # both seen: it raced


def test_sweep_leaves_other_dot_files_alone(tmp_path):
    """Files of other tools beside a checkpoint (`.ucp-cache`, `.a.ucp-`) are neither parsed as a
    killed save's leftovers nor an error (a bug: `.ucp-x` raised ValueError in every save there)."""
    from ucp_jax._src.format.writers import sweep

    for name in (".ucp-cache", ".a.ucp-", ".ucp-", ".hidden", ".b.ucp-other"):
        (tmp_path / name).write_text("x")
    (tmp_path / ".c.ucp-tmp").mkdir()
    sweep(str(tmp_path), keep="new")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".a.ucp-", ".b.ucp-other", ".hidden", ".ucp-", ".ucp-cache"]  # .c.ucp-tmp swept
