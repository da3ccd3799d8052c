"""The DLRMv3 trainer on the TPU path (torchax -> JAX; JAX's CPU backend without a TPU)."""
