"""unison: distributed self-supervised learning of visual representations, exact under DDP."""

__version__ = "0.1.0"
