"""axplug-serve: an OpenAI-compatible HTTP server for axplug models (`axplug serve`)."""

from axplug_serve.app import ServerSettings, create_app
from axplug_serve.worker import EngineWorker, QueueFullError

__all__ = ["EngineWorker", "QueueFullError", "ServerSettings", "create_app"]
