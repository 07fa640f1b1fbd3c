"""Remote prefill: the control-plane messages and the two small interfaces, one per side.

Caller side (`PrefillConnector`): the engine asks a worker to compute the KV of a
sequence's first `num_tokens` tokens and write the KV of tokens `first_token..` into the
caller's blocks `block_ids` (the sequence's blocks `first_token // block_size..`). What the
caller already holds (its prefix hits, a session's earlier turns) is never sent, to the
token: a follow-up turn moves only its new tokens. The worker computes the prefix it needs
for their attention from its own prefix cache, recomputing what it lacks. The engine
thread calls `submit` and `poll`; nothing else mutates the connector (a client may ask the
engine thread for an extra `poll` while it idles). Blocks of a request stay referenced by
the engine until `poll` reports the request done, or reports it failed *and fenced* (no
remote write can touch them any more).

Worker side (`PrefillService`, implemented by the worker application `kvsession.worker`):
accepts a handshake, then prefill requests, and writes the KV with its data plane (NIXL)
before answering.

Messages are msgspec msgpack structs (tagged union): no pickle, nothing executable. Both
sides can authenticate each other with CURVE keys (`AuthKeys`, docs/security.md).
"""

from __future__ import annotations

import abc
import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvsession.cache.block_pool import blocks_for
from kvsession.cache.identity import StorageIdentity
from kvsession.errors import ConfigError

# 2: HelloOk carries the worker's limits; Rejected, StatsQuery and WorkerStatus
# 3: PrefillRequest.first_token (writes start mid-block), PrefillDone.cached_tokens
PROTOCOL_VERSION = 3
MAX_CACHE_SALT = 1024  # characters
NO_HANDSHAKE = "no handshake"  # PrefillFailed.reason: the worker forgot us; say Hello again


class TensorDesc(msgspec.Struct, frozen=True):
    """One registered KV tensor of the caller: [num_layers, num_blocks, *block], block id in
    dim 1, contiguous."""

    name: str
    addr: int
    num_layers: int
    num_blocks: int
    block_bytes: int
    mem_type: str = "DRAM"  # NIXL memory type: "DRAM" (host) or "VRAM" (GPU)
    device_id: int = 0


class Hello(msgspec.Struct, tag=True):
    compat: str
    agent_name: str
    agent_metadata: bytes
    tensors: list[TensorDesc]


class HelloOk(msgspec.Struct, tag=True):
    agent_name: str
    max_tokens: int = 0  # longest token_ids a request may carry (the worker's max_model_len - 1)
    max_message_bytes: int = 0  # larger messages are rejected or dropped by the worker


class Refused(msgspec.Struct, tag=True):
    reason: str


class PrefillRequest(msgspec.Struct, tag=True):
    req_id: int
    token_ids: list[int]  # the whole context: the worker computes the KV of all of them
    first_block: int
    block_ids: list[int]  # the caller's blocks for blocks first_block.. of the sequence
    cache_salt: str | None = None
    # the first token whose KV is written (in block first_block); -1: first_block's start
    first_token: int = -1

    def write_from(self, block_size: int) -> int:
        return self.first_block * block_size if self.first_token < 0 else self.first_token


class PrefillDone(msgspec.Struct, tag=True):
    req_id: int
    num_bytes: int
    seconds: float
    cached_tokens: int = 0  # of token_ids, served by the worker's own prefix cache


class PrefillFailed(msgspec.Struct, tag=True):
    req_id: int
    reason: str


class Ping(msgspec.Struct, tag=True):
    t: float


class Pong(msgspec.Struct, tag=True):
    t: float


class Bye(msgspec.Struct, tag=True):
    pass


class Rejected(msgspec.Struct, tag=True):
    """The worker could not take a message it has no better answer for (malformed, too
    large, wrong frame count, unexpected type, a handshake while its queue is full)."""

    reason: str


class StatsQuery(msgspec.Struct, tag=True):
    pass


class WorkerStatus(msgspec.Struct, tag=True):
    """The worker's answer to `StatsQuery`: its pool (every block free and nothing held by
    a sequence once it is idle) and what it did with its input."""

    num_blocks: int
    free_blocks: int
    held_blocks: int  # block references held by in-flight sequences
    integrity: str  # "ok" or the pool's first failed invariant
    callers: int
    queued: int
    busy: bool  # a prefill is running
    served: int
    failed: int
    rejected: int


Message = Hello | HelloOk | Refused | PrefillRequest | PrefillDone | PrefillFailed | Ping | \
    Pong | Bye | Rejected | StatsQuery | WorkerStatus
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises msgspec.DecodeError / ValidationError on anything malformed."""
    return _decoder.decode(data)


def max_message_bytes(max_model_len: int) -> int:
    """The largest message a worker accepts: a request of max_model_len tokens (at most 9
    msgpack bytes per token id and per block id) plus 1 MiB for the handshake's agent
    metadata, tensor descriptors and the cache salt."""
    return 2**20 + 18 * max_model_len


def check_request(req: PrefillRequest, vocab: int, max_tokens: int, block_size: int) -> str:
    """Why a request cannot be served ("" if it can): checked on the socket thread, before
    it is queued, against the worker's model (a negative or out-of-vocabulary token id
    would index past the embedding table)."""
    n = len(req.token_ids)
    if n == 0:
        return "no token ids"
    if n > max_tokens:
        return f"{n} token ids; this worker takes at most {max_tokens}"
    if min(req.token_ids) < 0 or max(req.token_ids) >= vocab:
        bad = [t for t in req.token_ids if not 0 <= t < vocab][:5]
        return f"token ids {bad} are outside the vocabulary [0, {vocab})"
    total = blocks_for(n, block_size)
    if not 0 <= req.first_block < total:
        return f"first_block {req.first_block} is outside [0, {total}) for {n} tokens"
    start = req.write_from(block_size)
    if not (start < n and start // block_size == req.first_block):
        return f"first_token {req.first_token} is not in block {req.first_block} or not < {n}"
    if len(req.block_ids) != total - req.first_block:
        return f"{len(req.block_ids)} target blocks for {total - req.first_block} blocks to write"
    if min(req.block_ids) < 0 or len(set(req.block_ids)) != len(req.block_ids):
        return "block ids must be distinct and >= 0"
    if req.cache_salt is not None and len(req.cache_salt) > MAX_CACHE_SALT:
        return f"cache_salt longer than {MAX_CACHE_SALT} characters"
    return ""


def recv_message(sock, limit: int) -> tuple[bytes, bytes | None, str] | None:
    """(routing id, payload, error) of the next message; None when there is none. A message
    is one frame of at most `limit` bytes after the routing id; the frames of any other are
    read and dropped one by one (a ROUTER delivers a message whole: nothing blocks)."""
    import zmq

    try:
        ident = sock.recv(flags=zmq.NOBLOCK)
    except zmq.Again:
        return None
    payload, count, size = None, 0, 0
    while sock.getsockopt(zmq.RCVMORE):
        frame = sock.recv(copy=False)
        count, size = count + 1, size + len(frame)
        payload = frame.bytes if count == 1 and size <= limit else None
    if count != 1:
        return ident, None, f"expected one frame after the routing id, got {count}"
    if size > limit:
        return ident, None, f"a message of {size} bytes; this worker's limit is {limit}"
    return ident, payload, ""


def is_loopback_endpoint(endpoint: str) -> bool | None:
    """Whether `tcp://HOST:PORT` names a loopback host (an IP literal or "localhost"; a
    hostname, an interface name or '*' is not); None if it is not of that form."""
    m = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):(\d+)", endpoint)
    if m is None:
        return None
    host = m.group(1).strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def compat_hash(identity: StorageIdentity, compute_dtype: str) -> str:
    """Both sides must agree on this before any KV moves: the cache identity (model, kv
    dtype, block size, layout), the dtype the KV is computed in (a bfloat16 worker's KV is
    not the float32 caller's, and would change its tokens) and the protocol version."""
    return identity.digest(compute_dtype, PROTOCOL_VERSION)


@dataclass(frozen=True)
class Completion:
    """What `PrefillConnector.poll` reports about one request.

    kind: "done" (the KV is in the caller's blocks), "failed" (prefill it locally; `fenced`
    says whether its blocks may be reused now), or "fenced" (a request that failed earlier
    can no longer be written to: release its quarantined blocks)."""

    seq_id: int
    kind: str
    reason: str = ""
    fenced: bool = True
    num_bytes: int = 0
    seconds: float = 0.0


class PrefillConnector(abc.ABC):
    """Caller side. Used only from the engine thread."""

    @abc.abstractmethod
    def healthy(self) -> bool:
        """At least one worker has completed the handshake and answers heartbeats."""

    def accepts(self, num_tokens: int) -> bool:
        """A healthy worker takes a request of `num_tokens` tokens (its limits)."""
        return self.healthy()

    def refusal(self, num_tokens: int) -> str:
        """Why no worker would take a request of `num_tokens` tokens now ("" if one would):
        the reason its local fallback (or, with remote_prefill="required", its failure) is
        counted under in `fallbacks`."""
        if not self.healthy():
            return "no healthy worker"
        return "" if self.accepts(num_tokens) else "prompt too long for the workers"

    def count_fallback(self, reason: str) -> None:
        """A request prefilled here (or failed, with remote_prefill="required") instead of
        on a worker, counted under `reason` in `fallbacks` (stats().remote.fallbacks): the
        connector is the one writer of its counters."""
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    def expected_cached_tokens(self, keys: list[bytes], num_tokens: int) -> int:
        """How many leading tokens of a request of `num_tokens` tokens with these block
        hashes the worker it would go to now probably has cached (its own prefix cache):
        the cost model's expected worker-side hit."""
        return 0

    @abc.abstractmethod
    def submit(self, seq_id: int, token_ids: list[int], first_token: int,
               block_ids: list[int], keys: list[bytes], cache_salt: str | None) -> bool:
        """Ask a worker (chosen by prefix affinity on `keys`, the block hashes of
        `token_ids`' full blocks, with bounded load) to compute the KV of `token_ids` and
        write that of tokens first_token.. into `block_ids` (the sequence's blocks
        first_token // block_size..). False: no worker can take it (prefill locally;
        nothing was sent)."""

    @abc.abstractmethod
    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        """Drive progress, heartbeats and timeouts; return what completed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Say goodbye to the workers and release every registration."""


class PrefillService(abc.ABC):
    """Worker side."""

    @abc.abstractmethod
    def handshake(self, caller: str, hello: Hello) -> HelloOk | Refused:
        """Accept a caller (register its agent) or refuse it with a reason."""

    @abc.abstractmethod
    def prefill(self, caller: str, request: PrefillRequest) -> PrefillDone | PrefillFailed:
        """Compute the KV and write it into the caller's blocks; answer only when every
        write has completed."""

    @abc.abstractmethod
    def disconnect(self, caller: str) -> None:
        """Forget a caller (its agent metadata and any state)."""


# ---- authentication keys (CURVE, Z85-encoded; docs/security.md) -----------------------------

KEY_FILE_HELP = "docs/security.md, 'Key files'"


@dataclass(frozen=True, repr=False)
class AuthKeys:
    """One side's CURVE keys: its own keypair and its peers' public keys (a worker: the
    callers it accepts; a caller: the workers' public key, exactly one)."""

    role: str  # "worker" | "caller"
    public: bytes
    secret: bytes
    peers: tuple[bytes, ...]

    def __repr__(self) -> str:  # never print a secret key
        return f"AuthKeys(role={self.role!r}, public={self.public!r}, peers={len(self.peers)})"

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP credentials provider (`zmq.auth`): a worker admits its peers' keys only."""
        return key in self.peers


def _z85_key(value: str, what: str, path: Path) -> bytes:
    from zmq.utils import z85

    key = value.strip().strip('"').encode()
    try:
        ok = len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, IndexError):
        ok = False
    if not ok:
        raise ConfigError(f"key file {str(path)!r}: {what} is not a Z85-encoded CURVE key "
                          f"(40 characters); see {KEY_FILE_HELP}")
    return key


def load_keys(path, role: str) -> AuthKeys:
    """Read a key file written by `python -m kvsession.worker --make-keys DIR`: lines
    `name = value` (lines starting with `#` are comments): `role` (worker or caller),
    `public-key`, `secret-key`, and `peer-key` once per peer. ConfigError (one line) for
    anything else."""
    try:
        import zmq
    except ImportError as e:
        raise ConfigError(f"CURVE keys need pyzmq: pip install 'kvsession[remote]' ({e})") \
            from None
    path = Path(os.fspath(path))
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"key file {str(path)!r} cannot be read: "
                          f"{getattr(e, 'strerror', None) or e}") from None
    fields: dict[str, list[str]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):  # whole-line comments only: Z85 has '#'
            continue
        name, sep, value = (x.strip() for x in line.partition("="))
        if not sep or name not in ("role", "public-key", "secret-key", "peer-key"):
            raise ConfigError(f"key file {str(path)!r} line {n}: expected 'role', "
                              f"'public-key', 'secret-key' or 'peer-key = VALUE'; see "
                              f"{KEY_FILE_HELP}")
        fields.setdefault(name, []).append(value)
    for name in ("role", "public-key", "secret-key"):
        if len(fields.get(name, ())) != 1:
            raise ConfigError(f"key file {str(path)!r} needs exactly one '{name}' line")
    if fields["role"][0] != role:
        raise ConfigError(f"key file {str(path)!r} is a {fields['role'][0]!r} key file; "
                          f"this side needs the {role!r} one")
    public = _z85_key(fields["public-key"][0], "public-key", path)
    secret = _z85_key(fields["secret-key"][0], "secret-key", path)
    if zmq.curve_public(secret) != public:
        raise ConfigError(f"key file {str(path)!r}: public-key does not belong to secret-key")
    peers = tuple(_z85_key(v, "peer-key", path) for v in fields.get("peer-key", ()))
    if not peers or (role == "caller" and len(peers) != 1):
        want = "one peer-key (the workers' public key)" if role == "caller" else \
            "at least one peer-key (a caller's public key)"
        raise ConfigError(f"key file {str(path)!r} needs {want}")
    return AuthKeys(role, public, secret, peers)


def _key_file_text(role: str, public: bytes, secret: bytes, peer: bytes) -> str:
    peer_doc = ("an allowed caller's public key; add one line per caller" if role == "worker"
                else "the workers' public key")
    use = ("python -m kvsession.worker --auth-key-file FILE" if role == "worker"
           else "LLM(..., prefill_auth_key_file=FILE)")
    return (f"# kvsession {role} key file, for {use}.\n"
            f"# SECRET: it holds this {role}'s CURVE secret key. See {KEY_FILE_HELP}.\n"
            f"role = {role}\npublic-key = {public.decode()}\nsecret-key = {secret.decode()}\n"
            f"# {peer_doc}\npeer-key = {peer.decode()}\n")


def write_keys(directory) -> tuple[Path, Path]:
    """Create `worker.keys` and `caller.keys` (mode 0600) in `directory`: a fresh worker
    keypair and caller keypair, each file naming the other's public key. Refuses to
    overwrite (ConfigError)."""
    import zmq

    d = Path(os.fspath(directory))
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    for role in ("worker", "caller"):
        if (d / f"{role}.keys").exists():
            raise ConfigError(f"{str(d / f'{role}.keys')!r} exists; not overwriting a key file")
    worker_pub, worker_sec = zmq.curve_keypair()
    caller_pub, caller_sec = zmq.curve_keypair()
    out = []
    for role, pub, sec, peer in (("worker", worker_pub, worker_sec, caller_pub),
                                 ("caller", caller_pub, caller_sec, worker_pub)):
        path = d / f"{role}.keys"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(f"{str(path)!r} exists; not overwriting a key file") from None
        with os.fdopen(fd, "w") as f:
            f.write(_key_file_text(role, pub, sec, peer))
        out.append(path)
    return out[0], out[1]
