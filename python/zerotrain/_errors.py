"""The exceptions zerotrain raises: the engine's own (from the C++ extension) and the front end's."""
from ._C import CommError, ConfigError, DataError, EngineError  # noqa: F401

__all__ = ["ConfigError", "DataError", "CommError", "EngineError"]
