"""Sources of fake plugin modules for the `plugin_site` fixture (axplug_testing)."""

# Module sources whose `Dense` passes the check of its kind when loaded (registry._kinds).
# LAYER's is also shaped as a kernel (is_supported and __call__), so one fake serves both.
LAYER = '''
from axplug.layers.base import BaseLayer


class Dense(BaseLayer):
    """A fake dense layer."""

    def is_supported(self, *args):
        return True
'''
STORAGE = '''
from axplug.checkpoint import LocalStorage


class Dense(LocalStorage):
    """A fake storage."""
'''
MODIFIER = '''
from axplug.config import ConfigModifier


class Dense(ConfigModifier):
    """A fake modifier."""
'''
