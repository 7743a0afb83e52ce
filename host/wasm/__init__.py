"""The WebAssembly layer: the wasmtime engine and compiled-component cache, instance threads,
their limits and the epoch callback. Import the modules directly."""
