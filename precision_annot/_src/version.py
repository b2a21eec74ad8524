"""The version of precision_annot, in one place (`pyproject.toml` reads it from here)."""

__all__ = ["VERSION"]

VERSION = "0.7.0"
