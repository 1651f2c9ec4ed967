"""The runtime: the host, its sessions and each session's actor tree.

``Host`` (root nursery) → ``TraceSink`` and one ``SessionSupervisor`` per running session →
``LLMStreamer``, ``ToolPool``, ``ApprovalBroker``, ``Compactor``; ``storage`` holds the
data-dir layout and ``errors`` the typed exceptions. Import the public names from
``greenroom.actors``.
"""
