"""recir.lower_gpu: Lower a RecIR StepGraph to the GPU stack: Inductor, FBGEMM and torch.distributed."""

__version__ = "0.1.0"

__all__ = ["__version__"]
