"""The engine: request queue and loop thread, scheduler, model runner, sampler."""
