"""recir.distributed: RecIR meshes, parallel modes, sharding plans and collective-inserting transforms."""

__version__ = "0.1.0"

__all__ = ["__version__"]
