"""kvsession.kernels: Triton kernels and their torch reference twins.

This folder is packaged as `kvsession.kernels`; it is never importable as a top-level
`kernels` module. `reference` is pure torch and is what the engine runs on CPU.
"""
