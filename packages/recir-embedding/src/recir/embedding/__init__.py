"""recir.embedding: RecIR embedding tables, TorchRec/FBGEMM overrides, backends and sparse row-wise updates."""

__version__ = "0.1.0"

__all__ = ["__version__"]
