"""dspark: a speculative-decoding inference server."""

from dspark.config import EngineConfig, SamplingParams, SpecConfig

__all__ = ["LLM", "EngineConfig", "SamplingParams", "SpecConfig"]
__version__ = "0.1.0"


def __getattr__(name):
    # importing torch and the model stack only when LLM is asked for keeps the CLI fast to start
    if name == "LLM":
        from dspark.llm import LLM

        return LLM
    raise AttributeError(name)


def __dir__():
    return sorted([*globals(), "LLM"])
