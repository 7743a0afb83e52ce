"""The backend in processes of its own: `client` (ProcessBackend, the host's side), `server`
(`python -m gpu_backend.engine.server`, the engine's side), `wire` (msgpack of the batch format)
and `tp` (tensor parallel over torch.distributed)."""
