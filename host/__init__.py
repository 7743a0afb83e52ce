"""The Python host: runs WebAssembly inferlets and batches their forwards into one backend."""

__version__ = "0.1.0"
