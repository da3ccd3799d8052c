"""recir.capture: Capture a whole PyTorch training step (forward, backward, optimizer) as one functional StepGraph."""

__version__ = "0.1.0"

__all__ = ["__version__"]
