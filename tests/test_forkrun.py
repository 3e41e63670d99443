"""tests/forkrun.py, the launcher of the trainers' ranks (fixture_cache.torchrun): torchrun's
environment per rank, a failing rank fails the run at once, nothing the ranks leave behind holds
the run open."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from fixture_cache import torchrun

pytest.importorskip("torch")

SCRIPT = """
import json, os, subprocess, sys, time


def main():
    rank = int(os.environ["RANK"])
    mode, out = sys.argv[1], sys.argv[2]
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({k: os.environ[k] for k in keys} | {"argv": sys.argv[1:]}, f)
    if mode == "fail" and rank == 1:
        raise RuntimeError("rank 1 fails")
    if mode == "fail":
        time.sleep(120)  # stopped by the launcher
    if mode == "orphan":  # a helper process that outlives its rank (as Megatron's workers can)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


if __name__ == "__main__":  # (forkrun runs the top level once more, before forking)
    main()
"""


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "ranks.py"
    p.write_text(SCRIPT)
    return str(p)


def test_each_rank_gets_torchruns_environment(tmp_path, script):
    torchrun(script, 3, ["ok", str(tmp_path)], str(tmp_path))
    envs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [(str(r), str(r)) for r in range(3)]
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs} == {
        ("3", "3", "127.0.0.1")
    }
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and envs[0]["argv"] == ["ok", str(tmp_path)]


def test_a_failing_rank_stops_the_others_and_fails_the_run(tmp_path, script):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 fails") as e:
        torchrun(script, 2, ["fail", str(tmp_path)], str(tmp_path))
    assert "rank 1 exited with 1; stopping the others" in str(e.value)
    assert time.monotonic() - t0 < 60  # twice (one retry), without the 120 s sleep


def test_a_process_a_rank_left_behind_does_not_hold_the_run(tmp_path, script):
    """A rank's helper process inherited the output pipe: the launch waited for it to end."""
    t0 = time.monotonic()
    torchrun(script, 2, ["orphan", str(tmp_path)], str(tmp_path), timeout=60)
    assert time.monotonic() - t0 < 40
    left = subprocess.run(["pgrep", "-f", "import time; time.sleep(120)"], capture_output=True)
    assert left.stdout.strip() == b"", "the session's leftovers were not killed"
