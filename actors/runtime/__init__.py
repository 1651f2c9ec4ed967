"""The runtime: the host, its sessions and each session's actor tree.

``Host`` (root nursery) → ``TraceStore`` (a ``SessionCatalog``, a ``TraceLog`` and a
``UsageLedger``; the file backend writes through a ``Disk``) and one ``SessionSupervisor``
per running session → ``LLMStreamer``, ``ToolPool``, ``ApprovalBroker`` (a task's
``TaskWork``); the supervisor drives the pure task and turn machines through ``TurnRunner``
and ``CompactionRun``, and the work sees a session only through its ``SessionPort``;
``storage`` holds the data-dir layout and ``errors`` the typed exceptions. Import the
public names from ``greenroom.actors``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from greenroom.actors.runtime.accounting import PrincipalBudget
    from greenroom.actors.runtime.admission import ProviderLimits
    from greenroom.actors.runtime.command_hooks import install_tool_hooks, load_hooks_file
    from greenroom.actors.runtime.disk import Disk
    from greenroom.actors.runtime.errors import (
        AuthLocked,
        Busy,
        ConfigurationError,
        GreenroomError,
        HooksFileError,
        HostClosed,
        ImageRefused,
        NotPending,
        OutputSchemaError,
        SeqRefused,
        SessionClosed,
        SessionExists,
        SessionNotFound,
        SessionOpenElsewhere,
    )
    from greenroom.actors.runtime.host import (
        Host,
        SessionInfo,
        SessionObserver,
        default_data_dir,
    )
    from greenroom.actors.runtime.llm_streamer import ModelProvider
    from greenroom.actors.runtime.port import Approval, ApproveFn, SessionPort
    from greenroom.actors.runtime.receipts import InputReceipt, queued_once_recorded
    from greenroom.actors.runtime.session import (
        RunResult,
        RunStream,
        Session,
    )
    from greenroom.actors.runtime.storage import SessionStore
    from greenroom.actors.runtime.subagents import spawn_subagent
    from greenroom.actors.runtime.tool_pool import current_tool_context
    from greenroom.actors.runtime.trace_sink import (
        LEDGER_FILE_NAME,
        latest_trace_file,
        read_trace,
        usage_report,
    )
    from greenroom.actors.runtime.trace_store import (
        FileTraceStore,
        SessionCatalog,
        TraceLog,
        TraceStore,
        UsageLedger,
    )

# Loaded on first use: the modules import each other, and importing the package must
# not import them all (nor pay for the ones a program never uses).
_MODULE_OF = {
    "PrincipalBudget": "greenroom.actors.runtime.accounting",
    "ProviderLimits": "greenroom.actors.runtime.admission",
    "Approval": "greenroom.actors.runtime.port",
    "ApproveFn": "greenroom.actors.runtime.port",
    "SessionPort": "greenroom.actors.runtime.port",
    "AuthLocked": "greenroom.actors.runtime.errors",
    "Busy": "greenroom.actors.runtime.errors",
    "ConfigurationError": "greenroom.actors.runtime.errors",
    "GreenroomError": "greenroom.actors.runtime.errors",
    "HooksFileError": "greenroom.actors.runtime.errors",
    "HostClosed": "greenroom.actors.runtime.errors",
    "ImageRefused": "greenroom.actors.runtime.errors",
    "NotPending": "greenroom.actors.runtime.errors",
    "OutputSchemaError": "greenroom.actors.runtime.errors",
    "SeqRefused": "greenroom.actors.runtime.errors",
    "SessionClosed": "greenroom.actors.runtime.errors",
    "SessionExists": "greenroom.actors.runtime.errors",
    "SessionNotFound": "greenroom.actors.runtime.errors",
    "SessionOpenElsewhere": "greenroom.actors.runtime.errors",
    "Host": "greenroom.actors.runtime.host",
    "SessionInfo": "greenroom.actors.runtime.host",
    "SessionObserver": "greenroom.actors.runtime.host",
    "default_data_dir": "greenroom.actors.runtime.host",
    "ModelProvider": "greenroom.actors.runtime.llm_streamer",
    "InputReceipt": "greenroom.actors.runtime.receipts",
    "queued_once_recorded": "greenroom.actors.runtime.receipts",
    "RunResult": "greenroom.actors.runtime.session",
    "RunStream": "greenroom.actors.runtime.session",
    "Session": "greenroom.actors.runtime.session",
    "SessionStore": "greenroom.actors.runtime.storage",
    "spawn_subagent": "greenroom.actors.runtime.subagents",
    "current_tool_context": "greenroom.actors.runtime.tool_pool",
    "install_tool_hooks": "greenroom.actors.runtime.command_hooks",
    "load_hooks_file": "greenroom.actors.runtime.command_hooks",
    "latest_trace_file": "greenroom.actors.runtime.trace_sink",
    "read_trace": "greenroom.actors.runtime.trace_sink",
    "LEDGER_FILE_NAME": "greenroom.actors.runtime.trace_sink",
    "usage_report": "greenroom.actors.runtime.trace_sink",
    "Disk": "greenroom.actors.runtime.disk",
    "FileTraceStore": "greenroom.actors.runtime.trace_store",
    "SessionCatalog": "greenroom.actors.runtime.trace_store",
    "TraceLog": "greenroom.actors.runtime.trace_store",
    "TraceStore": "greenroom.actors.runtime.trace_store",
    "UsageLedger": "greenroom.actors.runtime.trace_store",
}

__all__ = [
    "LEDGER_FILE_NAME",
    "Approval",
    "ApproveFn",
    "AuthLocked",
    "Busy",
    "ConfigurationError",
    "Disk",
    "FileTraceStore",
    "GreenroomError",
    "HooksFileError",
    "Host",
    "HostClosed",
    "ImageRefused",
    "InputReceipt",
    "ModelProvider",
    "NotPending",
    "OutputSchemaError",
    "PrincipalBudget",
    "ProviderLimits",
    "RunResult",
    "RunStream",
    "SeqRefused",
    "Session",
    "SessionCatalog",
    "SessionClosed",
    "SessionExists",
    "SessionInfo",
    "SessionNotFound",
    "SessionObserver",
    "SessionOpenElsewhere",
    "SessionPort",
    "SessionStore",
    "TraceLog",
    "TraceStore",
    "UsageLedger",
    "current_tool_context",
    "default_data_dir",
    "install_tool_hooks",
    "latest_trace_file",
    "load_hooks_file",
    "queued_once_recorded",
    "read_trace",
    "spawn_subagent",
    "usage_report",
]


if not TYPE_CHECKING:  # type checkers see the imports above, and no catch-all

    def __getattr__(name: str) -> Any:
        module = _MODULE_OF.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from importlib import import_module

        value = globals()[name] = getattr(import_module(module), name)
        return value
