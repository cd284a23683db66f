"""The snapshot store: content-addressed chunks, record last, atomic against crashes and full disks, retention."""

import errno
import os
import subprocess
import uuid

import pytest

from swarmrun.node.state.store import SnapshotStore, Storage, open_ref
from swarmrun.node.state.run import FrozenState
from swarmrun.protocol.errors import IncompatibleState, RunNotFound, SwarmrunError, UsageError
from swarmrun.protocol.manifest import build_manifest
from swarmrun.protocol.snapshot import CHUNKS_DIR, parse_store_ref, record_path

SPEC_HASH = "ab" * 32


def frozen_state(step: int, *, changed: int = 0, size: int = 4096, chunk_size: int = 512) -> FrozenState:
    """A state of ``size`` bytes; the first ``changed`` bytes depend on the step (the rest is shared)."""
    data = bytearray(i % 251 for i in range(size))
    for i in range(changed):
        data[i] = (data[i] + step) % 256
    manifest = build_manifest(spec_hash=SPEC_HASH, step=step, tensors=[("model/w", "uint8", (size,), bytes(data))],
                              content={"cursor_note": step}, chunk_size=chunk_size)
    return FrozenState(manifest=manifest, data=memoryview(bytes(data)))


class Crash(BaseException):
    """A process dying mid-write (BaseException: nothing above may catch and carry on)."""


class FaultyStorage(Storage):
    """Faults by data: ``fail_on(kind, n, error)`` fails the n-th write of a chunk or a record."""

    def __init__(self, url, *, kind: str, n: int, error: BaseException, partial: bool = True):
        super().__init__(url)
        self.kind, self.n, self.error, self.partial, self.count = kind, n, error, partial, 0

    def write_atomic(self, rel, data):
        if rel.startswith(CHUNKS_DIR if self.kind == "chunk" else "snapshots"):
            self.count += 1
            if self.count == self.n:
                if self.partial:  # what a killed writer leaves: half a temp file
                    with open(self.path(f"tmp/{uuid.uuid4().hex}"), "wb") as f:
                        f.write(bytes(memoryview(data).cast("B")[: len(data) // 2]))
                raise self.error
        super().write_atomic(rel, data)


def test_roundtrip_shares_chunks_and_reads_newest(tmp_path):
    store = SnapshotStore(str(tmp_path / "s"))
    first = store.write(frozen_state(1, changed=10), signed_spec=b"spec")
    second = store.write(frozen_state(2, changed=10), signed_spec=b"spec")
    assert first.chunks_written == 8 and first.chunks_reused == 0
    assert second.chunks_written == 1 and second.chunks_reused == 7  # only the first chunk changed
    assert store.steps() == [1, 2]
    snap = store.load()
    assert snap.frozen.step == 2 and snap.where.endswith("@2")
    assert snap.frozen.manifest.state_hash() == frozen_state(2, changed=10).manifest.state_hash()
    assert bytes(snap.frozen.data) == bytes(frozen_state(2, changed=10).data)
    assert store.load(1).frozen.manifest == frozen_state(1, changed=10).manifest
    assert store.read_record(2).signed_spec == b"spec"
    with pytest.raises(RunNotFound):
        store.load(7)


def test_retention_keeps_last_k_and_collects_unreferenced_chunks(tmp_path):
    store = SnapshotStore(str(tmp_path / "s"), keep=2)
    for step in range(1, 5):
        result = store.write(frozen_state(step, changed=600), signed_spec=b"spec")  # chunks 0 and 1 change
    assert result.dropped == (2,)
    assert store.steps() == [3, 4]
    on_disk = set(os.listdir(tmp_path / "s" / "chunks"))
    wanted = set(store.read_record(3).manifest.chunks) | set(store.read_record(4).manifest.chunks)
    assert on_disk == wanted and len(on_disk) == 8 + 2
    assert all(not faults for faults in store.verify().values())


@pytest.mark.parametrize("kind, n", [("chunk", 1), ("chunk", 2), ("record", 1)])
def test_crash_during_write_leaves_previous_snapshot_loadable(tmp_path, kind, n):
    url = str(tmp_path / "s")
    SnapshotStore(url).write(frozen_state(1, changed=600), signed_spec=b"spec")
    faulty = SnapshotStore(url, storage=FaultyStorage(url, kind=kind, n=n, error=Crash()))
    with pytest.raises(Crash):
        faulty.write(frozen_state(2, changed=600), signed_spec=b"spec")
    store = SnapshotStore(url)
    assert store.steps() == [1]
    assert store.load().frozen.step == 1
    assert store.verify() == {1: []}
    # the next writer completes the interrupted snapshot
    store.write(frozen_state(2, changed=600), signed_spec=b"spec")
    assert store.load().frozen.step == 2


def test_injected_enospc_is_a_clear_error_and_previous_stays(tmp_path):
    url = str(tmp_path / "s")
    SnapshotStore(url).write(frozen_state(1, changed=600), signed_spec=b"spec")
    full = FaultyStorage(url, kind="chunk", n=2, error=OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(SwarmrunError, match="disk is full"):
        SnapshotStore(url, storage=full).write(frozen_state(2, changed=600), signed_spec=b"spec")
    store = SnapshotStore(url)
    assert store.load().frozen.step == 1 and store.verify() == {1: []}


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs: a real full disk (the tests run as root, like CI)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    assert done.returncode == 0, f"mounting a tmpfs needs root: {done.stderr}"
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_disk_leaves_previous_snapshot_loadable(small_tmpfs):
    url = str(small_tmpfs / "s")
    store = SnapshotStore(url)
    store.write(frozen_state(1, size=24 * 1024, changed=24 * 1024, chunk_size=4096), signed_spec=b"spec")
    with pytest.raises(SwarmrunError, match="disk is full"):  # a second, entirely different state does not fit
        store.write(frozen_state(2, size=48 * 1024, changed=48 * 1024, chunk_size=4096), signed_spec=b"spec")
    assert store.steps() == [1]
    assert store.load().frozen.step == 1 and store.verify() == {1: []}


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_damaged_chunk_is_found_by_verify_and_refused_by_load(tmp_path, damage):
    store = SnapshotStore(str(tmp_path / "s"))
    store.write(frozen_state(1), signed_spec=b"spec")
    digest = store.read_record(1).manifest.chunks[3]
    path = tmp_path / "s" / "chunks" / digest
    if damage == "corrupt":
        raw = bytearray(path.read_bytes())
        raw[5] ^= 1
        path.write_bytes(bytes(raw))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    else:
        path.unlink()
    faults = store.verify()
    assert len(faults[1]) == 1 and "chunk 3" in faults[1][0]
    with pytest.raises(IncompatibleState, match="chunk 3"):
        store.load(1)


def test_foreign_or_truncated_record_is_refused(tmp_path):
    store = SnapshotStore(str(tmp_path / "s"))
    store.write(frozen_state(1), signed_spec=b"spec")
    record = tmp_path / "s" / record_path(1)
    record.write_bytes(record.read_bytes()[:-7])
    with pytest.raises(IncompatibleState, match="corrupt"):
        store.load(1)
    assert store.verify()[1] and "corrupt" in store.verify()[1][0]
    (tmp_path / "s" / record_path(2)).write_bytes(b"\x93hello")
    with pytest.raises(RunNotFound):  # no complete snapshot left
        store.load()


def test_store_refs():
    assert parse_store_ref("/a/b@12") == ("/a/b", 12)
    assert parse_store_ref("s3://bucket/run") == ("s3://bucket/run", None)
    assert parse_store_ref("/a/b@x") == ("/a/b@x", None)
    with pytest.raises(UsageError):
        parse_store_ref("@3")
    store, step = open_ref("memory://refs@4")
    assert store.url == "memory://refs" and step == 4


def test_fsspec_memory_store_roundtrip():
    url = f"memory://swarmrun-{uuid.uuid4().hex}"
    store = SnapshotStore(url, keep=1)
    store.write(frozen_state(1, changed=600), signed_spec=b"spec")
    store.write(frozen_state(2, changed=600), signed_spec=b"spec")
    assert store.steps() == [2] and store.load().frozen.step == 2 and store.verify() == {2: []}
    store.storage.fs.rm(store.storage.root, recursive=True)


_KILLED_WRITER = """
import sys, threading, time
sys.path.insert(0, {root!r})
from swarmrun.node.state.store import SnapshotStore, Storage
from tests.unit.test_snapshot_store import frozen_state

say = threading.Lock()  # chunks are written from a thread pool: one whole line at a time (print's parts interleave)

class Slow(Storage):
    def write_atomic(self, rel, data):
        if rel.startswith("snapshots"):
            with say:
                print("record", flush=True)
            time.sleep(60)  # killed here: every chunk written, the record not
        super().write_atomic(rel, data)
        with say:
            print("wrote", rel, flush=True)
        time.sleep(0.05)

url = {url!r}
SnapshotStore(url).write(frozen_state(1, changed=4096), signed_spec=b"spec")
SnapshotStore(url, storage=Slow(url)).write(frozen_state(2, changed=4096), signed_spec=b"spec")
"""


@pytest.mark.timeout(180)  # a child process that imports torch: slow to start on a loaded 2-core machine
@pytest.mark.parametrize("kill_after", ["chunk", "record"])
def test_kill_9_during_write_leaves_previous_snapshot_loadable(tmp_path, kill_after):
    """A real writer process SIGKILLed between chunks, or between the last chunk and the record."""
    import signal
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    url = str(tmp_path / "s")
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER.format(root=root, url=url)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        seen = 0
        for line in child.stdout:
            seen += line.startswith("wrote chunks/") and SnapshotStore(url).steps() == [1]
            if (kill_after == "chunk" and seen == 3) or (kill_after == "record" and line.startswith("record")):
                os.killpg(child.pid, signal.SIGKILL)
                break
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait(timeout=30)
    store = SnapshotStore(url)
    assert store.steps() == [1] and seen >= 3
    assert store.load().frozen.step == 1 and store.verify() == {1: []}
