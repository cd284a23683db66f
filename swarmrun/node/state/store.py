"""The snapshot store: a directory or any fsspec URL holding content-addressed chunks and one record per snapshot.

Layout::

    STORE/chunks/<digest>                       the bytes of one chunk (shared between snapshots)
    STORE/snapshots/<step, 12 digits>.snapshot  the record: manifest, signed spec, amendment history
    STORE/tmp/                                  files being written (renamed into place when complete)

Atomicity (invariant 4): chunks are written first, the record last; every file is written to ``tmp/``,
flushed, fsynced and renamed into place (then its directory is fsynced), so a crash or a full disk at any
point leaves every earlier snapshot loadable, and a snapshot without its record does not exist. Retention
deletes records first and unreferenced chunks after, so an interrupted garbage collection only leaves
garbage. On an object store (s3://, gs://, ...) an object appears whole or not at all, which is the same
guarantee without fsync.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from swarmrun.protocol.errors import IncompatibleState, ProtocolError, RunNotFound, SwarmrunError, UsageError
from swarmrun.protocol.snapshot import (
    CHUNKS_DIR,
    RECORDS_DIR,
    SnapshotRecord,
    parse_store_ref,
    record_path,
    retained,
    step_of_record_path,
)
from swarmrun.node.state.run import FrozenState

logger = logging.getLogger("swarmrun.snapshot")
TMP_DIR = "tmp"
STALE_TMP_S = 3600.0  # a temp file this old belongs to a writer that died
IO_THREADS = 4  # chunks written/read/hashed in parallel (hashing and file I/O release the GIL)


class Storage:
    """The byte-level operations a store needs, on a local directory (with fsync) or an fsspec filesystem.

    Tests wrap it to inject faults (a crash, ENOSPC) by data.
    """

    def __init__(self, url: str):
        import fsspec

        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ValueError, ImportError) as e:
            raise UsageError(f"snapshot store {url!r}: {e}") from None
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        self.root = self.root.rstrip("/") or "/"

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def makedirs(self) -> None:
        for d in (CHUNKS_DIR, RECORDS_DIR, TMP_DIR):
            self.fs.makedirs(self.path(d), exist_ok=True)

    def write_atomic(self, rel: str, data) -> None:
        """Write ``data`` at ``rel`` whole or not at all (temp file, flush, fsync, rename, fsync the directory)."""
        tmp = self.path(f"{TMP_DIR}/{rel.replace('/', '_')}.{uuid.uuid4().hex[:8]}")
        if self.local:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data).cast("B")
                while view.nbytes:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                _unlink_quietly(tmp)
                raise
            os.close(fd)
            os.replace(tmp, self.path(rel))
            _fsync_dir(os.path.dirname(self.path(rel)))
            return
        try:
            self.fs.pipe_file(tmp, bytes(data))
            self.fs.mv(tmp, self.path(rel))
        except BaseException:
            try:
                self.fs.rm_file(tmp)
            except Exception:
                pass
            raise

    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def size(self, rel: str) -> Optional[int]:
        try:
            return int(self.fs.size(self.path(rel)))
        except (FileNotFoundError, OSError):
            return None

    def listdir(self, rel: str) -> dict[str, dict]:
        """Names (last component) -> info (size, mtime when the filesystem has it); {} if absent."""
        try:
            entries = self.fs.ls(self.path(rel), detail=True)
        except (FileNotFoundError, OSError):
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in entries if e.get("type") != "directory"}

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm_file(self.path(rel))
        except FileNotFoundError:
            pass


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass(frozen=True)
class Snapshot:
    """A snapshot read back from a store: its record and its verified state."""

    record: SnapshotRecord
    frozen: FrozenState
    where: str  # STORE@STEP


@dataclass(frozen=True)
class WriteResult:
    step: int
    where: str
    chunks_written: int
    chunks_reused: int
    bytes_written: int
    seconds: float
    dropped: tuple[int, ...]  # snapshots removed by retention


class SnapshotStore:
    """Snapshots of runs in one directory or fsspec URL; keeps the newest ``keep`` (``None``: all)."""

    def __init__(self, url: str, *, keep: Optional[int] = None, storage: Optional[Storage] = None):
        self.url = url
        self.keep = keep
        self.storage = storage or Storage(url)

    # ---- writing -------------------------------------------------------------------------------------
    def write(self, frozen: FrozenState, *, signed_spec: bytes, history: tuple[bytes, ...] = (),
              writer: str = "") -> WriteResult:
        """Write a snapshot of ``frozen``: missing chunks, then the record, then retention.

        Raises:
            SwarmrunError: the store cannot be written (full disk, permissions); earlier snapshots stay loadable.
        """
        t0 = time.perf_counter()
        manifest = frozen.manifest
        st = self.storage
        try:
            st.makedirs()
            present = {name: info.get("size") for name, info in st.listdir(CHUNKS_DIR).items()}
            todo: dict[str, int] = {}  # digest -> chunk index (a chunk repeated in one state is written once)
            for index, digest in enumerate(manifest.chunks):
                if present.get(digest) == frozen.chunk(index).nbytes or digest in todo:
                    continue
                if digest in present:  # same name, wrong size: a damaged chunk of an earlier snapshot
                    logger.warning(f"chunk {digest[:12]} in {self.url} has the wrong size; rewriting it")
                todo[digest] = index
            with ThreadPoolExecutor(IO_THREADS) as pool:
                # list(): the first error (a full disk) is raised here, before the record is written
                list(pool.map(lambda item: st.write_atomic(f"{CHUNKS_DIR}/{item[0]}", frozen.chunk(item[1])),
                              todo.items()))
            written, reused = len(todo), len(manifest.chunks) - len(todo)
            nbytes = sum(frozen.chunk(i).nbytes for i in todo.values())
            record = SnapshotRecord(manifest=manifest, signed_spec=signed_spec, history=tuple(history),
                                    writer=writer, written_at=time.time())
            st.write_atomic(record_path(manifest.step), record.encode())
        except OSError as e:
            why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise SwarmrunError(f"could not write a snapshot of step {manifest.step} to {self.url}: {why} "
                                f"(earlier snapshots are untouched)") from None
        dropped = self.collect_garbage() if self.keep is not None else ()
        return WriteResult(step=manifest.step, where=f"{self.url}@{manifest.step}", chunks_written=written,
                           chunks_reused=reused, bytes_written=nbytes, seconds=time.perf_counter() - t0,
                           dropped=tuple(dropped))

    def collect_garbage(self) -> list[int]:
        """Apply keep-last-K, then delete chunks no kept record references and stale temp files.

        Returns the steps whose snapshots were dropped. A record that cannot be read keeps nothing alive but is
        left in place for ``verify`` to report.
        """
        st = self.storage
        kept, dropped = retained(self.steps(), self.keep or 1)
        try:
            for step in dropped:
                st.remove(record_path(step))
            referenced: set[str] = set()
            for step in self.steps():
                try:
                    referenced.update(self.read_record(step).manifest.chunks)
                except SwarmrunError:
                    continue
            for name in st.listdir(CHUNKS_DIR):
                if name not in referenced:
                    st.remove(f"{CHUNKS_DIR}/{name}")
            now = time.time()
            for name, info in st.listdir(TMP_DIR).items():
                mtime = info.get("mtime") or info.get("created") or now
                if isinstance(mtime, (int, float)) and now - mtime > STALE_TMP_S:
                    st.remove(f"{TMP_DIR}/{name}")
        except OSError as e:
            logger.warning(f"garbage collection of {self.url} stopped: {e}")
        return dropped

    # ---- reading -------------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps of the snapshots in the store (records present), ascending."""
        out = (step_of_record_path(n) for n in self.storage.listdir(RECORDS_DIR))
        return sorted(s for s in out if s is not None)

    def read_record(self, step: int) -> SnapshotRecord:
        """Raises RunNotFound (no such snapshot) or IncompatibleState (unreadable, truncated, foreign)."""
        try:
            data = self.storage.read(record_path(step))
        except (FileNotFoundError, OSError):
            raise RunNotFound(f"no snapshot of step {step} in {self.url} (have: {self._have()})") from None
        try:
            record = SnapshotRecord.decode(data)
        except ProtocolError as e:
            raise IncompatibleState(f"snapshot {self.url}@{step} is corrupt or not a swarmrun snapshot: {e}") from None
        if record.manifest.step != step:
            raise IncompatibleState(f"snapshot {self.url}@{step} holds the state of step {record.manifest.step}")
        return record

    def _have(self) -> str:
        steps = self.steps()
        return ", ".join(map(str, steps)) if steps else "none"

    def complete(self, step: int) -> bool:
        """The record reads and every chunk it names is present with the right size (hashes not checked)."""
        try:
            manifest = self.read_record(step).manifest
        except SwarmrunError:
            return False
        sizes = {n: i.get("size") for n, i in self.storage.listdir(CHUNKS_DIR).items()}
        return all(sizes.get(d) == (lambda r: r[1] - r[0])(manifest.chunk_range(i)) for i, d in enumerate(manifest.chunks))

    def newest_step(self) -> int:
        """The step of the newest complete snapshot.

        Raises:
            RunNotFound: the store holds none.
        """
        for step in reversed(self.steps()):
            if self.complete(step):
                return step
            logger.warning(f"snapshot {self.url}@{step} is incomplete; trying an older one")
        raise RunNotFound(f"no complete snapshot in {self.url}")

    def load(self, step: Optional[int] = None) -> Snapshot:
        """Read a snapshot (``None``: the newest complete one) and verify every chunk and tensor.

        Raises:
            RunNotFound: no such snapshot. IncompatibleState: a chunk is missing, truncated or corrupt.
        """
        step = self.newest_step() if step is None else step
        record = self.read_record(step)
        manifest = record.manifest
        buf = bytearray(manifest.total_bytes)
        view = memoryview(buf)

        def fetch(index: int) -> str:
            digest = manifest.chunks[index]
            start, end = manifest.chunk_range(index)
            try:
                data = self.storage.read(f"{CHUNKS_DIR}/{digest}")
            except (FileNotFoundError, OSError):
                return f"chunk {index} ({digest[:12]}) is missing"
            if not manifest.verify_chunk(index, data):
                return f"chunk {index} ({digest[:12]}) is truncated or corrupt"
            view[start:end] = data
            return ""

        def tensor_fault(entry) -> str:
            ok = manifest.verify_tensor(entry, view[entry.offset:entry.offset + entry.nbytes])
            return "" if ok else f"tensor {entry.name} does not match its hash"

        with ThreadPoolExecutor(IO_THREADS) as pool:
            faults = [f for f in pool.map(fetch, range(len(manifest.chunks))) if f]
            # chunks verified; the tensor digests (what state_hash covers) are checked against the same bytes
            faults = faults or [f for f in pool.map(tensor_fault, manifest.tensors) if f]
        if faults:
            raise IncompatibleState(f"snapshot {self.url}@{step}: {faults[0]}")
        frozen = FrozenState(manifest=manifest, data=view.toreadonly())
        return Snapshot(record=record, frozen=frozen, where=f"{self.url}@{step}")

    def verify(self) -> dict[int, list[str]]:
        """Check every chunk of every snapshot in the store: {step: faults} (all lists empty: clean)."""
        out: dict[int, list[str]] = {}
        for step in self.steps():
            faults: list[str] = []
            try:
                manifest = self.read_record(step).manifest
            except SwarmrunError as e:
                out[step] = [str(e)]
                continue
            for index, digest in enumerate(manifest.chunks):
                try:
                    data = self.storage.read(f"{CHUNKS_DIR}/{digest}")
                except (FileNotFoundError, OSError):
                    faults.append(f"chunk {index} ({digest[:12]}) is missing")
                    continue
                if not manifest.verify_chunk(index, data):
                    faults.append(f"chunk {index} ({digest[:12]}) is truncated or corrupt")
            out[step] = faults
        return out


def open_ref(ref: str, *, keep: Optional[int] = None) -> tuple[SnapshotStore, Optional[int]]:
    """``STORE`` or ``STORE@STEP`` -> (store, step or None)."""
    url, step = parse_store_ref(ref)
    return SnapshotStore(url, keep=keep), step
