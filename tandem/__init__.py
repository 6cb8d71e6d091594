"""Tandem: giant MoE LLMs from one GPU plus system RAM, behind an OpenAI-compatible API."""

__version__ = "0.1.0"

from tandem.core import SamplingParams  # noqa: E402


def __getattr__(name: str):  # lazy: importing tandem must not load the engine
    if name == "LLM":
        from tandem.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
