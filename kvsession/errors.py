"""The exception hierarchy. Every error kvsession raises on purpose derives from KVSessionError."""


class KVSessionError(Exception):
    """Base class of every kvsession error."""


class ConfigError(KVSessionError, ValueError):
    """A constructor or call argument is invalid; raised before any memory is taken."""


class ModelLoadError(KVSessionError):
    """A checkpoint directory cannot be loaded (missing file, bad tensor, unsupported arch)."""


class UnsupportedArchitectureError(ConfigError, ModelLoadError):
    """The checkpoint's architecture is not one kvsession runs: a bad `model` argument
    (ConfigError, as for every argument) found while reading the checkpoint (ModelLoadError,
    so callers catching load failures see it too)."""


class CacheFullError(KVSessionError):
    """The KV cache cannot hold what was asked (a pin over budget, a sequence that cannot fit)."""


class SnapshotError(KVSessionError):
    """A session snapshot file is invalid, incompatible or corrupted."""


class SessionClosedError(KVSessionError):
    """A closed session (or a closed LLM) was used."""


class RemotePrefillError(KVSessionError):
    """Remote prefill failed and local fallback was disabled."""


class EngineClosedError(SessionClosedError):
    """The engine was closed while a call was pending or after it was closed."""


class SessionLockedError(KVSessionError):
    """The session is owned by another live process (its lock file in session_dir is held):
    one process at a time works on a session."""


class SessionLostError(SnapshotError):
    """Crash recovery removed the session's log (no intact record was left) and nothing
    else of the session remains: the id is a tombstone, not a fresh session, until the
    caller asks for one (`llm.session(session_id=..., fresh=True)`)."""

    def __init__(self, message: str, session_id: str | None = None):
        super().__init__(message)
        self.session_id = session_id

    def __reduce__(self):  # (pickles whole: the default would drop session_id)
        return type(self), (str(self), self.session_id)


class SessionStoreError(KVSessionError):
    """`session_dir` is an object store that could not be read for this session (down,
    failing, a transfer cut short) and this machine has no copy of what it holds: whether
    the session exists there is unknown, so it is neither resumed nor started anew (a new
    one would replace the store's copy). Retry once the store answers."""
