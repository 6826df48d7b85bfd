"""``mindqwen serve``: the OpenAI API over FastAPI + uvicorn (``pip install mindqwen[serve]``).

``protocol.py`` holds the typed request bodies, ``worker.py`` the model thread that batches
requests, ``app.py`` the HTTP application and the ``Server`` that runs it.
"""
from mindqwen.serve.app import Server

__all__ = ["Server"]
