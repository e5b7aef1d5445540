"""Chat for axplug: templates (rendered in a sandbox) and chat fine-tuning data
(`axplug prepare-chat`: conversations tokenized with a loss mask on the assistant's turns)."""

from axplug_chat.encoder import TRAIN_ON, ChatEncoder, conversation, rendered_segments
from axplug_chat.template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from axplug_chat.trained import trained_template

__all__ = [
    "ChatTemplate",
    "DEFAULT_CHAT_TEMPLATE",
    "ChatEncoder",
    "TRAIN_ON",
    "conversation",
    "rendered_segments",
    "trained_template",
]
