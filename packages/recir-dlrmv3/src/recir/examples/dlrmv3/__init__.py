"""Runnable DLRMv3 examples: `python -m recir.examples.dlrmv3.tpu.train` and `...gpu.train`, thin entry
points over `recir-dlrmv3 train` (shipped by the recir-dlrmv3 distribution)."""
