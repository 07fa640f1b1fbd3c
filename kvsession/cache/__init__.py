"""The device KV cache: block bookkeeping (BlockPool), hashes, prefix lookup, tensors."""
