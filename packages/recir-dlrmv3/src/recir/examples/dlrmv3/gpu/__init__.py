"""The DLRMv3 trainer on the GPU path (Inductor; on the CPU device without CUDA)."""
