"""Model descriptions and the batched forward: `config` (ModelConfig, ModelInfo), `llama` (the
Llama-family decoder over the paged cache), `rope` (rotary tables, llama3 scaling)."""
