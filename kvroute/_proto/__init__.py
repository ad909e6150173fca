"""Generated gRPC stubs for engine discovery (vLLM ``vllm.Control``, SGLang ``sglang.runtime.v1.SglangService``).

Do not edit: regenerate with ``python proto/generate.py`` (``--check`` verifies the committed copies).
"""
