"""Reading models from disk: `loader` (GGUF or HF directory -> weights, config, tokenizer spec),
`gguf`, `hf_dir`, `model_files`, `paths` (the default model, the cache dir) and `tokenizer`
(byte-level BPE on tiktoken, chat templates on jinja2)."""
