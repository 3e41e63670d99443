"""Listing the checkpoints of an object-store folder touches one key per checkpoint (its index
entry, format/index.py), not every object under the folder; folders without a complete index
(checkpoints saved by older versions) are still listed, by the old full listing, until a save or
`ucp index` indexes them. Against a real S3 server (moto, on loopback, behind a WSGI layer that
counts what every request touched) and the in-process memory:// store."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from mp.runner import free_port

import ucp_jax as ucp
from ucp_jax._src.cli import main as cli_main
from ucp_jax._src.errors import ArgumentError
from ucp_jax._src.format import index, store
from ucp_jax._src.format.manifest import MANIFEST

BUCKET = "ucp-listing"
N = 12  # checkpoints
LEAVES = 8  # arrays per checkpoint (per-array layout: several objects each)


class Counting:
    """A WSGI layer over moto: the keys its list responses return and the objects read."""

    def __init__(self, app: Any) -> None:
        self.app, self.lock = app, threading.Lock()
        self.listed: list[str] = []  # keys returned by ListObjects responses
        self.reads: list[str] = []  # object GET / HEAD paths
        self.read_bytes = 0  # bytes of the objects' GET responses

    def reset(self) -> None:
        with self.lock:
            self.listed, self.reads, self.read_bytes = [], [], 0

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        body = b"".join(self.app(environ, start_response))
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        query = environ.get("QUERY_STRING", "")
        with self.lock:
            if method == "GET" and path.strip("/") == BUCKET and "list-type" in query:
                text = body.decode()
                self.listed += [k.split("</Key>")[0] for k in text.split("<Key>")[1:]]
            elif method in ("GET", "HEAD") and path.startswith(f"/{BUCKET}/"):
                self.reads.append(path[len(BUCKET) + 2 :])
                self.read_bytes += len(body) if method == "GET" else 0
        return [body]


@pytest.fixture(scope="module")
def s3() -> Iterator[Counting]:
    """A moto S3 server on 127.0.0.1 whose every request is counted; the AWS variables set."""
    try:
        import boto3
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server
    except ImportError as e:
        pytest.skip(f"moto[server] is not installed ({e})")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    counting = Counting(DomainDispatcherApplication(create_backend_app))

    class Server(ThreadedMotoServer):
        def _server_entry(self) -> None:  # moto's own, with the counting layer around its app
            self._server = make_server(self._ip_address, self._port, counting, True,
                                       request_handler=MotoRequestHandler)  # fmt: skip
            self._server_ready_event.set()
            self._server.serve_forever()

    port = free_port()
    server = Server(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    mp = pytest.MonkeyPatch()
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint}.items():  # fmt: skip
        mp.setenv(k, v)
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        yield counting
    finally:
        mp.undo()
        server.stop()


def _tree(i: int) -> dict[str, np.ndarray]:
    return {f"w{j}": np.full((64, 32), i * 100 + j, np.float32) for j in range(LEAVES)}


def _unindex(root: str) -> None:
    """Remove the folder's index: what a folder of checkpoints saved by an older ucp_jax is."""
    loc = store.Location.parse(root)
    for key in loc.list_keys(index.INDEX + "/", index.INDEX + "0"):
        loc.delete(key)


def test_s3_listing_reads_one_key_per_checkpoint(s3, monkeypatch, caplog):
    monkeypatch.setenv("UCP_LAYOUT", "per-array")  # version 2: one object per chunk and more
    root = f"s3://{BUCKET}/run"
    want = [f"{root}/step_{i:02d}" for i in range(N)]
    for i in range(N):
        ucp.save(want[i], _tree(i), step=i)
    everything = store.Location.parse(root).list_keys()
    per_checkpoint = (len(everything) - N - 1) / N
    assert per_checkpoint >= 3 * LEAVES, f"{per_checkpoint:.1f} objects per checkpoint: too few"

    s3.reset()
    assert ucp.list_checkpoints(root) == want
    assert len(s3.listed) == N + 1, s3.listed  # one index entry each, and `.complete`
    assert all(k.startswith("run/.ucp-index/") for k in s3.listed), s3.listed
    assert s3.reads == [], s3.reads  # no object read

    # A folder whose checkpoints an older ucp_jax saved (no index): listed all the same, by
    # listing every key, and the log says how to index it.
    _unindex(root)
    s3.reset()
    with caplog.at_level(logging.INFO, logger="ucp_jax"):
        assert ucp.list_checkpoints(root) == want
    assert len(s3.listed) == len(everything) - N - 1  # every object of every checkpoint
    assert f"ucp index {root}" in caplog.text

    # `ucp index` indexes it (one full listing); then one key per checkpoint again.
    assert cli_main(["index", root]) == 0
    s3.reset()
    assert cli_main(["ls", root]) == 0
    assert len(s3.listed) == N + 1 and s3.reads == []

    # The first save into an unindexed folder indexes the checkpoints already there.
    _unindex(root)
    ucp.save(f"{root}/step_{N:02d}", _tree(N), step=N)
    s3.reset()
    assert ucp.list_checkpoints(root) == [*want, f"{root}/step_{N:02d}"]
    assert len(s3.listed) == N + 2 and s3.reads == []


@pytest.fixture
def mem_root(request) -> str:
    return f"memory://listing-{request.node.name}/run"


def test_index_entries_follow_commits_and_overwrites(mem_root):
    root = mem_root
    ucp.save(f"{root}/a", _tree(1), step=1)
    ucp.save(f"{root}/b", _tree(2), step=2)
    loc = store.Location.parse(root)
    assert index.indexed(loc) == ["a", "b"]
    assert loc.read(f"{index.INDEX}/a") == loc.read("a/COMMIT")  # the entry holds COMMIT's bytes

    # An overwrite killed while it deletes the old objects: its entry went before its COMMIT.
    def killed(self: store.Location) -> None:
        raise RuntimeError("killed while deleting")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(store.Location, "remove_all", killed)
        with pytest.raises(RuntimeError, match="killed while deleting"):
            ucp.save(f"{root}/a", _tree(3), step=3, overwrite=True)
    assert loc.read("a/COMMIT") is None
    assert ucp.list_checkpoints(root) == [f"{root}/b"]
    ucp.save(f"{root}/a", _tree(3), step=3)
    assert ucp.list_checkpoints(root) == [f"{root}/a", f"{root}/b"]
    assert ucp.open(f"{root}/a").step == 3


def test_a_committed_checkpoint_missing_from_the_index_is_added_back(mem_root):
    """A save killed between COMMIT and its index entry: not listed; the next save to that path
    refuses to replace it, and adds the entry, so that it lists again."""
    root = mem_root
    for n in ("a", "b"):
        ucp.save(f"{root}/{n}", _tree(1), step=1)
    loc = store.Location.parse(root)
    loc.delete(f"{index.INDEX}/b")
    assert ucp.list_checkpoints(root) == [f"{root}/a"]
    with pytest.raises(FileExistsError, match="already holds a committed checkpoint"):
        ucp.save(f"{root}/b", _tree(2), step=2)
    assert ucp.list_checkpoints(root) == [f"{root}/a", f"{root}/b"]


def test_ucp_index_drops_entries_of_checkpoints_deleted_by_other_tools(mem_root):
    root = mem_root
    for n in ("a", "b"):
        ucp.save(f"{root}/{n}", _tree(1), step=1)
    store.Location.parse(f"{root}/b").remove_all()  # `aws s3 rm --recursive`: the entry stays
    assert ucp.list_checkpoints(root) == [f"{root}/a", f"{root}/b"]
    assert cli_main(["index", root]) == 0
    assert ucp.list_checkpoints(root) == [f"{root}/a"]
    assert store.Location.parse(root).list_keys(".ucp-index/", ".ucp-index0") == [
        ".ucp-index/.complete", ".ucp-index/a"]  # fmt: skip


def test_a_half_deleted_checkpoint_is_not_indexed_or_listed(mem_root, caplog):
    """Another tool's deletion stopped with COMMIT left and manifest.json gone: as a local
    listing does, an index build (`ucp index`) and the listing without an index skip it with a
    warning (they took COMMIT alone, so the newest listed checkpoint did not open)."""
    root = mem_root
    for n in ("step_1", "step_2"):
        ucp.save(f"{root}/{n}", _tree(1), step=1)
    loc = store.Location.parse(root)
    loc.delete(f"step_2/{MANIFEST}")
    loc.delete(f"{index.INDEX}/step_2")  # the docs' advice for deletions by other tools
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        assert cli_main(["index", root]) == 0
        assert ucp.list_checkpoints(root) == [f"{root}/step_1"]
        _unindex(root)  # and the listing of every key, with no index
        assert ucp.list_checkpoints(root) == [f"{root}/step_1"]
    assert f"{root}/step_2 holds COMMIT but no manifest.json" in caplog.text
    assert f"ucp rm {root}/step_2" in caplog.text
    ucp.open(ucp.list_checkpoints(root)[-1])


def test_recovery_skips_a_listed_checkpoint_deleted_by_other_tools(mem_root, caplog):
    """The in-memory tier's fallback to the newest persisted checkpoint takes the next newest
    when the newest was deleted by another tool (its index entry still lists it)."""
    from ucp_jax._src.memory.recovery import newest_persisted

    root = mem_root
    for step in (1, 2, 3):
        ucp.save(f"{root}/step_{step}", _tree(step), step=step)
    store.Location.parse(f"{root}/step_3").remove_all()  # the entry of step_3 stays
    assert ucp.list_checkpoints(root)[-1] == f"{root}/step_3"
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        assert newest_persisted(root) == (f"{root}/step_2", 2)
    assert "step_3" in caplog.text and "ucp index" in caplog.text
    for step in (1, 2):
        store.Location.parse(f"{root}/step_{step}").remove_all()
    assert newest_persisted(root) is None


def test_index_names_are_untrusted(mem_root, caplog):
    """Entries that are not one plain path component, or hidden, are skipped with a warning."""
    root = mem_root
    ucp.save(f"{root}/good", _tree(1), step=1)
    loc = store.Location.parse(root)
    for bad in ("sub/x", "..", "a\\b", ".hidden", "nul\x00x"):
        loc.write(f"{index.INDEX}/{bad}", b"x")
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        assert ucp.list_checkpoints(root) == [f"{root}/good"]
    assert caplog.text.count("skipping") == 5, caplog.text
    assert "'sub/x'" in caplog.text and "checkpoint names are not hidden" in caplog.text


def test_spec_roots_and_bucket_roots(mem_root):
    """A kvstore spec root lists Locations; a checkpoint at the top of a store is indexed there."""
    bucket = mem_root.split("/run")[0]
    ucp.save(f"{bucket}/top", _tree(1), step=1)
    assert store.Location.parse(bucket).list_keys(".ucp-index/", ".ucp-index0") == [
        ".ucp-index/.complete", ".ucp-index/top"]  # fmt: skip
    ucp.save(f"{mem_root}/s", _tree(1), step=1)
    spec = {"driver": "memory", "path": mem_root.split("://")[1]}
    assert [str(c) for c in ucp.list_checkpoints(spec)] == [f"{mem_root}/s"]


def test_the_top_of_the_memory_store_lists_urls_that_open(request):
    """`memory://` has no path: its checkpoints listed as `memory:/name` (a relative local path,
    which opened or deleted a local folder `./memory:/name`); the refusal of a save at the top
    suggested that name too."""
    name = f"top-{request.node.name}"
    ucp.save(f"memory://{name}", _tree(1), step=1)
    listed = ucp.list_checkpoints("memory://")
    assert f"memory://{name}" in listed and all(u.startswith("memory://") for u in listed)
    assert ucp.open(f"memory://{name}").step == 1
    with pytest.raises(ArgumentError, match="under a name: memory://step_1"):
        ucp.save("memory://", _tree(1), step=1)


def test_ucp_index_of_a_local_folder_says_what_to_pass(tmp_path, capsys):
    ucp.save(tmp_path / "a", _tree(1), step=1)
    assert cli_main(["ls", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(tmp_path / "a")]
    assert cli_main(["index", str(tmp_path)]) == 1  # a user error, not an unexpected one (2)
    err = capsys.readouterr().err
    assert f"{tmp_path} is a local folder, which has no index to build" in err
    assert f"list it with ucp ls {tmp_path}" in err


@pytest.mark.parametrize("stray", ["notes_1\u00b2", "\u2460", "run_\u0663"])
def test_names_with_other_digits_sort_beside_checkpoints(tmp_path, mem_root, capsys, stray):
    # every name is sorted before any is filtered: "notes_1²" ('²' is a digit to str.isdigit,
    # not to int()) made `ucp ls` and list_checkpoints fail with a ValueError
    ucp.save(tmp_path / "step_2", _tree(1), step=2)
    (tmp_path / stray).write_bytes(b"")
    (tmp_path / f"{stray}_dir").mkdir()
    assert ucp.list_checkpoints(tmp_path) == [str(tmp_path / "step_2")]
    assert cli_main(["ls", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(tmp_path / "step_2")]
    # an object store's listing (no index: every key) sorts the same names
    root = f"{mem_root}/stray"
    ucp.save(f"{root}/step_2", _tree(1), step=2)
    ucp.save(f"{root}/{stray}", _tree(2), step=3)
    ucp.save(f"{root}/step_10", _tree(3), step=10)
    want = sorted(["step_2", stray, "step_10"], key=index.natural)
    assert ucp.list_checkpoints(root) == [f"{root}/{n}" for n in want]
    _unindex(root)
    assert ucp.list_checkpoints(root) == [f"{root}/{n}" for n in want]


def test_a_restore_reads_the_database_manifest_without_asking_for_it_per_array(s3):
    # A committed OCDBT database does not change: an opened checkpoint reads its arrays through
    # its own cache of the manifest. Each array's read asked for manifest.ocdbt again (a
    # conditional GET): 50-58 of ~350 requests of this restore, ~298 of ~590 of `ucp verify`;
    # then 24-31, one per array's batch of fingerprint reads after the restore: those arrays
    # are now fingerprinted in one batch per round (every process of a job asks that object).
    import jax
    from helpers import mesh_of
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    path = f"s3://{BUCKET}/manifest_reads/step_1"
    source = NamedSharding(mesh_of((2, 4)), P("a", "b"))
    state = {f"w{j}": jax.device_put(np.full((64, 64), j, np.float32), source) for j in range(16)}
    ucp.save(path, state, step=1)
    other = NamedSharding(mesh_of((4, 2)), P("b", "a"))
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other) for k, v in state.items()}
    s3.reset()
    got, _ = ucp.restore(path, target)
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v))
    manifests = sum(r.endswith("/manifest.ocdbt") for r in s3.reads)
    # 5 here (the checkpoint's opening, its arrays' opening, the fingerprints' two rounds);
    # 24-31 with a batch of fingerprint reads per array, 50-58 before that
    assert s3.reads and manifests <= 8, f"{manifests} of {len(s3.reads)} reads: {s3.reads[:40]}"
    s3.reset()
    assert cli_main(["verify", path]) == 0
    manifests = sum(r.endswith("/manifest.ocdbt") for r in s3.reads)
    # 31 here (444 requests -> 208): verify opens every array in one batch and fingerprints each
    # array in one; 151-156 with a batch per array opened and per block, 297 before that
    assert manifests <= 60, f"{manifests} of {len(s3.reads)} reads"


def test_small_values_of_a_data_file_are_read_in_few_requests(s3):
    # The chunks of small arrays and each array's zarr.json lie side by side in a writer's data
    # files; on an object store the database merges reads at most 16 KiB apart into one request.
    # 64 arrays of 16 KiB, resharded: the restore made 1163 GETs and the save 93 (77 of them
    # sealing the zarr.json files) reading each value alone; 159 and 30 merged. Arrays of
    # 4 MiB: no byte read twice; merging reads 1 MiB apart (as Orbax does) made the fingerprint
    # check's 4-byte reads at the end of each inner chunk whole-shard reads: 2-3x the state.
    import jax
    from helpers import mesh_of
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    source = NamedSharding(mesh_of((2, 4)), P("a", "b"))
    other = NamedSharding(mesh_of((4, 2)), P("b", "a"))
    rng = np.random.default_rng(0)
    counts = {}
    for name, n, shape in (("small", 64, (64, 64)), ("large", 4, (1024, 1024))):
        state = {f"w{j}": jax.device_put(rng.standard_normal(shape, np.float32), source)
                 for j in range(n)}  # fmt: skip
        path = f"s3://{BUCKET}/coalesced/{name}"
        s3.reset()
        ucp.save(path, state, step=1)
        saved = len(s3.reads)
        target = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other) for k, v in state.items()
        }
        s3.reset()
        got, _ = ucp.restore(path, target)
        for k, v in state.items():
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v))
        counts[name] = (saved, len(s3.reads), s3.read_bytes / (n * math.prod(shape) * 4))
    saved, restored, _ = counts["small"]
    assert saved <= 60, f"the save made {saved} GET/HEAD requests (30 here, 93 unmerged)"
    assert restored <= 300, f"the restore made {restored} (159 here, 1163 unmerged)"
    assert counts["large"][2] <= 1.05, f"the restore read {counts['large'][2]:.2f}x the state"
