"""Not torchvision: the names sglang's multimodal modules and transformers touch at import
time, so the real sglang wheel imports on the CPU test machine (where the real
torchvision is absent: its CUDA build breaks vLLM). Text-only contract tests use none of it."""
__version__ = "0.0.0+stub"
