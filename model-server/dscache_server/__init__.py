"""dscache model server: an OpenAI-compatible server that reuses cached prefix KV.

The package is split so that importing it stays light: ``cli`` parses arguments
only; ``engine``, ``attention``, ``kv``, ``loading`` and ``presets`` need torch and
transformers; ``app`` and its pieces (``routes``, ``completions``, ``parse``,
``schemas``, ``streaming``, ``state``, ``errors``) need FastAPI. Nothing here is a
singleton: ``runtime.build_runtime`` builds the objects and passes them down.
``docs/model-server.md`` has the map of which module does what.
"""

from __future__ import annotations

__all__: list[str] = []
