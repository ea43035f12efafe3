"""lmstack: the whole language-model stack in one small, readable, tested PyTorch package."""

__version__ = "0.1.0"
