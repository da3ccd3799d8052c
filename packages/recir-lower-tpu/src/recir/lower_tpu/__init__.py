"""recir.lower_tpu: Lower a RecIR StepGraph to the TPU stack: torchax to JAX/XLA with GSPMD."""

__version__ = "0.1.0"

__all__ = ["__version__"]
