"""The crc32 of every on-disk format (snapshots, segments, session logs).

ISA-L's crc32 (the `isal` package, a dependency) is the same checksum as zlib's and ~5x
faster: at zlib's ~2 GB/s, verifying a resumed session's 2k tokens of KV on load took as
long as reading them from the page cache. zlib's stays the fallback where no isal wheel
exists for the platform, so files stay readable everywhere."""

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; a platform without a wheel
    from zlib import crc32

__all__ = ["crc32"]
