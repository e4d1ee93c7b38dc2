"""paceline: an LLM inference server with stall-free chunked-prefill scheduling."""
from paceline.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked so `paceline.core` stays torch-free
    if name == "LLM":
        from paceline.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
