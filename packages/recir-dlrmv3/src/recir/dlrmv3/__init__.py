"""recir.dlrmv3: DLRMv3 (HSTU ranking) trained through RecIR on the GPU and TPU paths: model, data, trainers, CLI."""

__version__ = "0.1.0"

__all__ = ["__version__"]
