"""The replicas of `serve --replicas N` as Ray actors: start, wait for, stop and restart them.

Each replica is a `Replica` (kvsession/serve/ray_replica.py) in its own actor with
`--replica-num-cpus` / `--replica-num-gpus` (Ray places it: on a GPU of its own, or a
share of the CPUs) and `max_restarts`: when its process dies, Ray starts a fresh one (a new
LLM, an empty cache, a new port); after that many restarts it stays dead and the ingress
drops it. The ingress calls these from its event loop: every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kvsession.serve.ray_replica import Replica

# how often a restarting actor is asked again whether it is up (Ray answers "unavailable"
# while it restarts, not "wait")
_RETRY_S = 0.2
# what a graceful stop may take beyond its drain timeout (the Ray round trip, then
# `llm.close()` persisting the sessions): its bound, and the bound of what waits for it
STOP_GRACE_S = 10.0


class ReplicaGone(Exception):
    """The actor is dead for good (its restarts are spent, or it was killed without one),
    or it did not come up in time."""


@dataclass(frozen=True)
class ActorOptions:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_restarts: int = 5


class RayReplicas:
    """N named replica actors on the connected Ray cluster (ray.init was called)."""

    def __init__(self, n: int, model: str, llm_kwargs: dict, server_kwargs: dict, host: str,
                 options: ActorOptions, log_level: str = "warning",
                 start_timeout_s: float = 300.0):
        import ray

        self._ray = ray
        self.start_timeout_s = start_timeout_s
        cls = ray.remote(Replica).options(
            num_cpus=options.num_cpus, num_gpus=options.num_gpus,
            max_restarts=options.max_restarts, max_task_retries=0)
        self.names = [f"replica-{i}" for i in range(n)]
        self._actors = {
            name: cls.remote(name, model, llm_kwargs, server_kwargs, host, log_level,
                             start_timeout_s)
            for name in self.names}

    async def info(self, name: str, timeout_s: float | None = None) -> dict:
        """The replica's address and pid once it serves (waiting through a restart), or
        ReplicaGone."""
        ray = self._ray
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReplicaGone(f"{name} did not come up in time")
            try:
                return await asyncio.wait_for(self._actors[name].info.remote(), left)
            except ray.exceptions.ActorUnavailableError:
                await asyncio.sleep(min(_RETRY_S, max(0.0, left)))  # restarting
            except (ray.exceptions.RayActorError, TimeoutError) as e:
                raise ReplicaGone(f"{name}: {e}") from None

    async def stop(self, name: str, timeout_s: float = 60.0) -> bool:
        """Graceful stop (sessions persisted, locks released); the process stays up until
        `kill`. False when it did not answer in time (it is then killed anyway)."""
        try:
            return await asyncio.wait_for(self._actors[name].stop.remote(timeout_s),
                                          timeout_s + STOP_GRACE_S)
        except (self._ray.exceptions.RayError, TimeoutError):
            return False

    def kill(self, name: str, restart: bool) -> None:
        """End the actor's process; with `restart`, Ray starts a fresh one."""
        self._ray.kill(self._actors[name], no_restart=not restart)

    async def stop_all(self, timeout_s: float = 60.0) -> None:
        await asyncio.gather(*(self.stop(n, timeout_s) for n in self.names))
        for n in self.names:
            try:
                self.kill(n, restart=False)
            except self._ray.exceptions.RayError:
                pass  # already gone
