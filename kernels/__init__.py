"""kvsession.kernels: Triton kernels and their torch reference twins.

This folder is packaged as `kvsession.kernels`; it is never importable as a top-level
`kernels` module. `reference` is pure torch and is what the engine runs on CPU, but for
decode attention over a float32 or bfloat16 cache, which `cpu_decode` (a C++ kernel built at
first use) reads when it builds; the decode products of bfloat16 and int8 weights are C++
kernels too (`bf16_rows`, `q8_matmul`).
"""
