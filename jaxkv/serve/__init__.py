"""The serving engine: continuous batching on the tiered cache (see `jaxkv.serve.engine`)."""
