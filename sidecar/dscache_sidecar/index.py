"""The LMDB block index: key -> location, codec, checksum, tenant, parent, stats.

Databases in one LMDB environment (``<data_dir>/index``):
    * ``blocks``: 32-byte key -> packed ``BlockRecord``.
    * ``stats``: key -> (last access unix ms, hit count), flushed in batches so a hit
      never waits for a write transaction.
    * ``meta``: format version and segment geometry; a store reopened with another
      geometry refuses to start instead of misreading offsets.
    * ``tokens``: key -> the block's token ids (little-endian u32), for blocks whose
      writer gave them: read only to announce blocks in KV events
      (:mod:`dscache_sidecar.kvevents`), never on the read or write path's checks.

Invariant: a record exists only for a block whose bytes and header are on disk
(the store commits the index last). LMDB's own copy-on-write commits make the index
crash safe; ``sync`` follows the store's durability setting.

Readers in other processes: :class:`IndexReader` opens the same environment
read-only (LMDB allows any number of reader processes beside its one writer, each
registered in the lock file's reader table), so a client answers "how many leading
blocks are stored" without a round trip to the daemon. The daemon stays the only
writer. Its answer is a hint, as any lookup is: the lease that follows is checked
by the daemon again. LMDB keys reader slots by process id, so processes sharing one
environment must share a PID namespace (in Kubernetes: ``shareProcessNamespace``).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lmdb

_RECORD = struct.Struct("<IQQQQQBBB6I16s32sQ")
_STATS = struct.Struct("<QI")
INDEX_VERSION = b"1"
#: Where the 16-byte tenant id sits in a packed record (after the location,
#: sizes, checksum, codec, dtype and shape fields).
_TENANT_AT = struct.calcsize("<IQQQQQBBB6I")
TENANT_FIELD = slice(_TENANT_AT, _TENANT_AT + 16)


@dataclass(slots=True)
class BlockRecord:
    """Where a block lives and how to read it."""

    key: bytes
    segment: int
    offset: int  # extent start
    extent_bytes: int
    stored_bytes: int
    raw_bytes: int
    checksum: int
    codec: int
    dtype_code: int
    shape: tuple[int, ...]
    tenant: bytes
    parent: bytes
    created_ms: int
    last_access_ms: int = 0
    hits: int = 0

    def pack(self) -> bytes:
        dims = list(self.shape) + [0] * (6 - len(self.shape))
        return _RECORD.pack(
            self.segment,
            self.offset,
            self.extent_bytes,
            self.stored_bytes,
            self.raw_bytes,
            self.checksum,
            self.codec,
            self.dtype_code,
            len(self.shape),
            *dims,
            self.tenant,
            self.parent.ljust(32, b"\0"),
            self.created_ms,
        )

    @classmethod
    def unpack(cls, key: bytes, data: bytes) -> BlockRecord:
        f = _RECORD.unpack(data)
        ndim = f[8]
        parent = f[16]
        return cls(
            key=key,
            segment=f[0],
            offset=f[1],
            extent_bytes=f[2],
            stored_bytes=f[3],
            raw_bytes=f[4],
            checksum=f[5],
            codec=f[6],
            dtype_code=f[7],
            shape=tuple(f[9 : 9 + ndim]),
            tenant=f[15],
            parent=b"" if parent == b"\0" * 32 else parent,
            created_ms=f[17],
        )


def _drop_tenants_table(env: lmdb.Environment) -> None:
    """Removes the ``tenants`` table indexes before this release wrote on every
    commit and delete and nothing read (ClearTenant scans the catalog in memory)."""
    try:
        old = env.open_db(b"tenants", create=False, dupsort=True)
    except lmdb.NotFoundError:
        return
    with env.begin(write=True) as txn:
        txn.drop(old, delete=True)


class IndexGeometryError(Exception):
    """The index was written for another segment geometry."""


class BlockIndex:
    """The durable index. Not thread safe for writes: the store serialises them."""

    def __init__(self, path: Path, map_bytes: int, durable: bool) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(
            str(path),
            map_size=map_bytes,
            max_dbs=8,
            sync=durable,
            metasync=durable,
            lock=True,
            subdir=True,
        )
        self._blocks = self._env.open_db(b"blocks")
        _drop_tenants_table(self._env)
        self._stats = self._env.open_db(b"stats")
        self._meta = self._env.open_db(b"meta")
        self._tokens = self._env.open_db(b"tokens")

    def check_geometry(self, segment_bytes: int) -> None:
        """Records the geometry on first use; refuses a different one later."""
        want = f"v{INDEX_VERSION.decode()} segment_bytes={segment_bytes}".encode()
        with self._env.begin(write=True, db=self._meta) as txn:
            have = txn.get(b"geometry")
            if have is None:
                txn.put(b"geometry", want)
            elif have != want:
                raise IndexGeometryError(
                    f"index was created with {have.decode()}, now {want.decode()}; "
                    "use a new data directory or the old segment size"
                )

    def load(self) -> Iterator[BlockRecord]:
        """Every record, with access stats filled in."""
        with self._env.begin(db=self._blocks) as txn:
            stats_get = txn.get
            for key, value in txn.cursor():
                rec = BlockRecord.unpack(bytes(key), bytes(value))
                raw = stats_get(key, db=self._stats)
                if raw is not None:
                    rec.last_access_ms, rec.hits = _STATS.unpack(raw)
                yield rec

    def put_many(self, records: Iterable[BlockRecord], tokens: Sequence[bytes] = ()) -> None:
        """Publishes records in one transaction, with ``tokens[i]`` (when not empty)
        as the token ids of the ``i``-th record."""
        with self._env.begin(write=True) as txn:
            for i, rec in enumerate(records):
                txn.put(rec.key, rec.pack(), db=self._blocks)
                if i < len(tokens) and tokens[i]:
                    txn.put(rec.key, tokens[i], db=self._tokens)

    def delete_many(self, records: Iterable[BlockRecord]) -> None:
        """Removes records (and their stats and tokens) in one transaction."""
        with self._env.begin(write=True) as txn:
            for rec in records:
                txn.delete(rec.key, db=self._blocks)
                txn.delete(rec.key, db=self._stats)
                txn.delete(rec.key, db=self._tokens)

    def tokens_of(self, keys: Sequence[bytes]) -> list[bytes]:
        """The token ids stored for each of ``keys`` (empty where none), one read
        transaction."""
        with self._env.begin(db=self._tokens) as txn:
            return [txn.get(k) or b"" for k in keys]

    def write_stats(self, stats: Iterable[tuple[bytes, int, int]]) -> None:
        """Stores (key, last access ms, hits) for blocks that still exist."""
        with self._env.begin(write=True) as txn:
            for key, last_ms, hits in stats:
                if txn.get(key, db=self._blocks) is not None:
                    txn.put(key, _STATS.pack(last_ms, hits), db=self._stats)

    @contextmanager
    def scan_keys(self) -> Iterator[tuple[int, Iterator[bytes]]]:
        """Every block key of every tenant, in key order, and how many there are: one
        read transaction over the key table (values unread), open while the caller
        iterates. No lock: LMDB readers never wait for the writer."""
        with self._env.begin(db=self._blocks) as txn:
            total = int(txn.stat(self._blocks)["entries"])
            yield total, txn.cursor().iternext(keys=True, values=False)

    def last_change(self) -> int:
        """The id of the last committed write transaction. It changes on every write
        (records, deletes, and access statistics too), so an equal id means an
        unchanged index."""
        return int(self._env.info()["last_txnid"])

    def clear_stale_readers(self) -> int:
        """Frees reader slots whose process is gone (LMDB's ``mdb_reader_check``: a
        slot's owner is alive while it holds its lock on the lock file, so this
        works across PID namespaces too); returns how many were freed."""
        return int(self._env.reader_check())

    def reader_table(self) -> str:
        """LMDB's table of reader slots (pid, thread, txnid per line), for diagnosis."""
        return str(self._env.readers())

    def close(self) -> None:
        self._env.close()


class IndexReader:
    """A read-only view of a daemon's index from another process: lookups, no RPC.

    Args:
        path: the index directory (``<data_dir>/index``), written by a running or
            stopped daemon.

    Raises:
        lmdb.Error: the index does not exist yet, or this process cannot open it
            (LMDB refuses a second handle on one environment in one process: a
            daemon in this process holds it already).
    """

    def __init__(self, path: Path) -> None:
        data = path / "data.mdb"
        self._inode = os.stat(data).st_ino  # raises before LMDB would create anything
        self.path = path
        self._env = lmdb.open(
            str(path), readonly=True, lock=True, max_dbs=8, subdir=True, create=False
        )
        try:
            self._blocks = self._env.open_db(b"blocks", create=False)
        except BaseException:
            self._env.close()
            raise

    def replaced(self) -> bool:
        """Whether the index file on disk is no longer the one this reader opened."""
        try:
            return os.stat(self.path / "data.mdb").st_ino != self._inode
        except OSError:
            return True

    def leading(self, tenant: bytes, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` have a record of ``tenant`` (one short read txn)."""
        try:
            return self._leading(tenant, keys)
        except lmdb.MapResizedError:
            self._env.set_mapsize(0)  # adopt the writer's larger map, then once more
            return self._leading(tenant, keys)

    def _leading(self, tenant: bytes, keys: Sequence[bytes]) -> int:
        found = 0
        with self._env.begin(db=self._blocks, buffers=True) as txn:
            get = txn.get
            for key in keys:
                value = get(key)
                if value is None or value[TENANT_FIELD] != tenant:
                    break
                found += 1
        return found

    def close(self) -> None:
        """Closes the environment (its reader slots go with it)."""
        self._env.close()
