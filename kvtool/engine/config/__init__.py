"""Config documents and sizes as vLLM reads them."""
