"""KV tiers below the device: host DRAM, disk snapshots, and the policy that moves
sessions between them (the only place that decides spill, load or recompute)."""
