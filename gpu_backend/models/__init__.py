"""Model descriptions and the batched forward: `config` (ModelConfig, ModelInfo, VisionConfig,
ImageProcessing), `llama` (the Llama-family decoder over the paged cache), `rope` (rotary tables,
llama3 scaling), `vision` (a LLaVA's CLIP tower and projector), `image_preprocess` (image bytes to
pixel values with Pillow, as transformers' CLIP image processor)."""
