"""What a block looks like in the shared tier: its name, its value, and their checks.

Contract:
    * A block of tenant ``t`` under key ``k`` lives under
      ``<prefix>:v1:<t hex>:<k hex>`` (unsigned values) or ``<prefix>:v2:<t hex>:<k
      hex>`` (signed values); ``prefix`` is the namespace's (``shared_key_prefix``,
      default ``dscache``), so a Redis ACL user whose key pattern is ``~<prefix>:*``
      reaches its own namespace's blocks and no other's.
    * The value is ``magic, header length, header, stored bytes`` and, when signed,
      an HMAC-SHA256 over the name (tenant and key), the header and the bytes under
      the namespace's signing key. The header names the tenant, key, parent, layout
      and checksum (:class:`ValueFormat.pack`).
    * :meth:`ValueFormat.unpack` verifies before anything is used: with a signing
      key, a value whose MAC does not match under the key (or an earlier key still
      accepted while a new one rolls out) is :class:`ForgedValueError`, checked
      first, in constant time, before the header is parsed; then the header must
      name this tenant and key, its layout must pass the store's limits
      (``BlockSpec.validate``: a shape whose decoded size is over the largest block
      is refused, so a forged shape cannot set a decoder's output size), and the
      bytes must match the checksum, else :class:`CorruptValueError`.
    * Signed and unsigned values never meet: they live under different names
      (``v2``/``v1``), so a pod with a key never loads an unsigned value, and a pod of
      an older release never reads (nor deletes) a signed one.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from dscache.v1 import kvcache_pb2 as pb
from dscache_sidecar.blockstore import BlockSpec
from dscache_sidecar.codec import DTYPE_NAMES
from dscache_sidecar.index import BlockRecord
from dscache_sidecar.segments import checksum

__all__ = [
    "DEFAULT_PREFIX",
    "CorruptValueError",
    "ForgedValueError",
    "ValueFormat",
]

#: The remote names' prefix when the settings name none.
DEFAULT_PREFIX = "dscache"
_MAGIC = b"DSKV\x01"
_SIGNED_MAGIC = b"DSKV\x02"
_HEADER_LEN = struct.Struct("<I")
_MAC_BYTES = hashlib.sha256().digest_size
_MAC_CONTEXT = b"dscache/shared-value/v2\x00"


class CorruptValueError(ValueError):
    """A remote value that is not the block it should be."""


class ForgedValueError(CorruptValueError):
    """A value whose signature does not verify: written by someone without the key."""


@dataclass(frozen=True)
class ValueFormat:
    """Names and values of one namespace's blocks in the shared tier.

    Attributes:
        prefix: the names' first part (the namespace's ACL key pattern is ``prefix:*``).
        signing_key: the namespace's HMAC key; empty: values are neither signed nor
            checked for a signature (the v1 format, for setups without a key).
        verify_keys: earlier keys whose signatures are still accepted (rotation: a
            new key signs at once, values signed with the old one stay readable
            until they expire).
    """

    prefix: str = DEFAULT_PREFIX
    signing_key: bytes = b""
    verify_keys: Sequence[bytes] = ()

    @property
    def signed(self) -> bool:
        return bool(self.signing_key)

    def name(self, tenant_id: bytes, key: bytes) -> str:
        """The remote name of a block: the prefix, the format, the tenant id and key in hex."""
        version = "v2" if self.signed else "v1"
        return f"{self.prefix}:{version}:{tenant_id.hex()}:{key.hex()}"

    def _mac(self, secret: bytes, name: str, body: bytes) -> bytes:
        mac = hmac.new(secret, _MAC_CONTEXT, hashlib.sha256)
        mac.update(name.encode())
        mac.update(b"\x00")
        mac.update(body)
        return mac.digest()

    def pack(self, rec: BlockRecord, data: bytes) -> bytes:
        """The remote value of a stored block (signed when there is a signing key)."""
        header = pb.PutHeader(
            tenant=rec.tenant.hex(),
            block=pb.NewBlock(
                key=rec.key,
                parent=rec.parent,
                info=pb.BlockInfo(
                    dtype=DTYPE_NAMES[rec.dtype_code],
                    shape=list(rec.shape),
                    codec=rec.codec,  # type: ignore[arg-type]
                    raw_bytes=rec.raw_bytes,
                    stored_bytes=rec.stored_bytes,
                    checksum=rec.checksum,
                ),
            ),
        ).SerializeToString()
        magic = _SIGNED_MAGIC if self.signed else _MAGIC
        body = b"".join((magic, _HEADER_LEN.pack(len(header)), header, data))
        if not self.signed:
            return body
        return body + self._mac(self.signing_key, self.name(rec.tenant, rec.key), body)

    def _check_signature(self, name: str, value: bytes) -> bytes:
        """The value without its MAC; ForgedValueError unless a key we accept signed it."""
        if len(value) <= _MAC_BYTES or value[: len(_SIGNED_MAGIC)] != _SIGNED_MAGIC:
            raise ForgedValueError("not a signed dscache block value")
        body, mac = value[:-_MAC_BYTES], value[-_MAC_BYTES:]
        ok = False
        for secret in (self.signing_key, *self.verify_keys):
            ok |= hmac.compare_digest(self._mac(secret, name, body), mac)
        if not ok:
            raise ForgedValueError("the value's signature does not match the namespace's key")
        return body

    def unpack(
        self, tenant_id: bytes, key: bytes, value: bytes, max_stored: int
    ) -> tuple[BlockSpec, int, bytes]:
        """Verifies a remote value: (spec, checksum, stored bytes).

        Raises:
            ForgedValueError: signed format, and no accepted key signed this value.
            CorruptValueError: wrong format, another tenant's or key's block, a layout
                that does not validate, or bytes that do not match the checksum.
        """
        if self.signed:
            value = self._check_signature(self.name(tenant_id, key), value)
            magic = _SIGNED_MAGIC
        else:
            magic = _MAGIC
        start = len(magic) + _HEADER_LEN.size
        if len(value) < start or value[: len(magic)] != magic:
            raise CorruptValueError("not a dscache block value")
        (n,) = _HEADER_LEN.unpack_from(value, len(magic))
        header = pb.PutHeader()
        try:
            header.ParseFromString(value[start : start + n])
        except DecodeError as exc:
            raise CorruptValueError(f"unreadable header: {exc}") from exc
        block, info = header.block, header.block.info
        if header.tenant != tenant_id.hex() or bytes(block.key) != key:
            raise CorruptValueError("the value belongs to another tenant or key")
        spec = BlockSpec(
            key=key,
            parent=bytes(block.parent),
            codec=int(info.codec),
            dtype=info.dtype,
            shape=tuple(info.shape),
            raw_bytes=info.raw_bytes,
            stored_bytes=info.stored_bytes,
        )
        try:
            spec.validate(max_stored)
        except ValueError as exc:
            raise CorruptValueError(str(exc)) from exc
        data = value[start + n :]
        if len(data) != spec.stored_bytes or checksum(data) != info.checksum:
            raise CorruptValueError("the bytes do not match the block's checksum")
        return spec, info.checksum, data
