"""chatserve: a speculative-decoding-first, low-latency LLM chat engine and server."""

from chatserve.config import EngineConfig, ServerConfig, SpecConfig
from chatserve.sampling_params import SamplingParams

__all__ = ["Engine", "AsyncEngine", "Conversation", "EngineConfig", "SpecConfig", "ServerConfig", "SamplingParams"]


def __getattr__(name):  # keep `import chatserve` light: torch models load only when used
    if name == "Engine":
        from chatserve.engine import Engine

        return Engine
    if name in ("AsyncEngine", "Conversation"):
        from chatserve import async_engine

        return getattr(async_engine, name)
    raise AttributeError(name)
