"""Session settings: plain data with the defaults of SPEC.md."""

from __future__ import annotations

from typing import Literal

import attrs

DEFAULT_COMPACT_PROMPT = (
    "Summarize the conversation so far so that the work can continue in a fresh context. "
    "Keep the user's goals, decisions, facts learned, files touched and open questions. "
    "Write the summary between [summary] and [/summary]. Do not call any tool."
)

DEFAULT_MAX_IMAGE_BYTES = 5 * 1024 * 1024
"""The largest image file a session accepts (R-SEC-8): the Anthropic API's own limit per
image, so an image that passes here is not refused there for its size."""


@attrs.frozen(kw_only=True, slots=True)
class SessionSettings:
    """Everything that shapes a session's behaviour; stored with the session.

    ``max_turns`` (R-RUN-6) and ``max_session_turns`` (R-COMPACT-1) use -1 for no limit;
    ``max_context_length`` ≤ 0 compacts on no context size (R-COMPACT-1).
    ``tool_result_budget`` is in bytes (R-TOOL-8). ``approval_timeout_s`` bounds the wait
    for an approval (R-APPROVE-4) — None waits without limit, as a person may answer the
    next day (R-HITL-1); when it runs out, ``approval_timeout_action`` ``deny`` denies the
    call (by ``default``) and ``abort`` interrupts the task.

    Subagents (R-HOST-4): ``max_subagents_concurrent`` children of one task run at once
    (more wait for a slot); ``max_subagents_per_task`` children in all per task (beyond, the
    call is an error output; -1 for no limit); ``subagent_token_budget`` total tokens (the
    sum of its requests' ``total``) one child may use before it is interrupted and the call
    fails (-1 for no limit); a child's budget holds for its whole subtree: its descendants'
    tokens count against it (R-TREE-3). ``max_subagent_depth`` levels of subagents below a
    session that was not spawned (3: children, grandchildren and great-grandchildren, the
    last not offered ``spawn_subagent``; 1: children cannot spawn; 0: no subagents at all).
    Background children count against the concurrency limit while they run.

    Cost budgets (R-SHARE-4, in USD at the prices of :mod:`greenroom.protocols.prices`;
    None for no limit): ``max_cost_usd`` is what the session may spend over its whole life,
    its subagents' requests included (every request the ledger records for its tree:
    turns, compactions, titles); ``tree_cost_budget_usd`` is what each subagent it spawns
    may spend with its own subagents, as ``subagent_token_budget`` is for tokens. A task
    whose next request could pass a budget ends ``budget_exceeded`` before sending it.

    ``sandbox`` confines ``run_shell`` (R-SEC-3): ``auto`` uses bubblewrap when it is
    present, ``required`` refuses to run a command without it, ``off`` runs it unconfined
    (the environment is allow-listed in every mode). ``shell_network`` lets sandboxed
    commands reach the network.

    ``max_image_bytes`` is the largest image file the session accepts, in bytes (R-SEC-8):
    a larger one is refused when it is named, never read in full or sent.
    """

    provider: str = "scripted"
    """A name of the provider registry (``greenroom.actors.providers.registry``), the one
    authority on providers: an unknown one is refused when the session's client is made."""
    model: str = "scripted"
    base_url: str | None = None
    system: str | None = None
    max_tokens: int = 8192
    max_turns: int = -1
    max_context_length: int = 128_000
    max_session_turns: int = -1
    compact_mode: Literal["summarize", "discard"] = "summarize"
    compact_prompt: str = DEFAULT_COMPACT_PROMPT
    tool_result_budget: int = 32 * 1024
    approval_timeout_s: float | None = 300.0
    approval_timeout_action: Literal["deny", "abort"] = "deny"
    supports_vision: bool = True
    loop_repeat_threshold: int = 3
    loop_no_progress_threshold: int = 5
    max_subagents_concurrent: int = 3
    max_subagents_per_task: int = 8
    subagent_token_budget: int = 200_000
    max_subagent_depth: int = 3
    max_cost_usd: float | None = None
    tree_cost_budget_usd: float | None = None
    sandbox: Literal["auto", "required", "off"] = "auto"
    shell_network: bool = False
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
