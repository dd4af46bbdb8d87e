"""Engine connectors, installed as ``kvoffload.connectors`` (vLLM's is the ``vllm`` package)."""
