"""Simulated vLLM / SGLang engines: KV-event publishers, replay buffers, gRPC discovery, HTTP serving."""
