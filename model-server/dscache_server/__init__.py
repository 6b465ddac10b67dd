"""dscache model server: an OpenAI-compatible server that reuses cached prefix KV.

The package is split so that importing it stays light: ``cli`` parses arguments
only; ``engine``, ``kv`` and ``presets`` need torch and transformers; ``app``
needs FastAPI. Nothing here is a singleton: ``serve.build_runtime`` builds the
objects and passes them down.
"""

from __future__ import annotations

__all__: list[str] = []
