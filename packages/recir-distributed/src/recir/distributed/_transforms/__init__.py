"""recir-distributed's transforms, one per module: gradient all-reduce, FSDP sharding, table all-to-all."""
