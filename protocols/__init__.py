"""greenroom.protocols: pure typed data and sans-IO logic; no I/O, no trio.

The names most programs need are re-exported here; everything else lives in its module
(``greenroom.protocols.outputs``, ``.content``, ``.stream``, codecs…).
"""

from greenroom.protocols.content import (
    ImageBlock,
    ModelBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
    UserContent,
    user_image,
    user_text,
)
from greenroom.protocols.converter import output_from_dict, to_dict, to_json
from greenroom.protocols.outputs import (
    Abort,
    ApprovalDecision,
    ApprovalRequest,
    CallInDoubt,
    CallResolved,
    CompactionBegin,
    CompactionEnd,
    ModelMsg,
    Output,
    PartialText,
    PartialThinking,
    PartialToolCall,
    RequestBegin,
    RequestEnd,
    Rewind,
    TaskEnd,
    TaskStart,
    TokenUsageOutput,
    ToolCallOutput,
    ToolHook,
    ToolProgress,
    UserMsg,
)
from greenroom.protocols.settings import SessionSettings
from greenroom.protocols.stream import TokenUsage
from greenroom.protocols.tools import Tool, ToolContext, tool

__all__ = [
    "Abort",
    "ApprovalDecision",
    "ApprovalRequest",
    "CallInDoubt",
    "CallResolved",
    "CompactionBegin",
    "CompactionEnd",
    "ImageBlock",
    "ModelBlock",
    "ModelMsg",
    "Output",
    "PartialText",
    "PartialThinking",
    "PartialToolCall",
    "RedactedThinkingBlock",
    "RequestBegin",
    "RequestEnd",
    "Rewind",
    "SessionSettings",
    "TaskEnd",
    "TaskStart",
    "TextBlock",
    "ThinkingBlock",
    "TokenUsage",
    "TokenUsageOutput",
    "Tool",
    "ToolCallBlock",
    "ToolCallOutput",
    "ToolContext",
    "ToolHook",
    "ToolProgress",
    "UserContent",
    "UserMsg",
    "output_from_dict",
    "to_dict",
    "to_json",
    "tool",
    "user_image",
    "user_text",
]
