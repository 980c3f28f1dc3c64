"""The version of unison, at the bottom layer so that every layer can name it."""

__version__ = "0.1.0"
