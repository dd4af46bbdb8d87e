"""Engine connectors, installed as ``kvoffload.connectors`` (vLLM's lands in ``vllm.py``)."""
