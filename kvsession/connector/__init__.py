"""Remote prefill, library side: the protocol (`base`) and the NIXL data plane with the
caller's client (`nixl`). No API-layer imports here; the worker application that serves
prefills is `kvsession.worker`."""
