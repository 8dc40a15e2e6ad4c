"""The LLM reference server: a real vLLM (CPU build) serving a tiny Llama built on this machine."""
