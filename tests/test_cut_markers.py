"""Every marker of a text cut to fit one record of a session's trace names one figure: the
bytes of that record, not the room what else it carries leaves the text (R-SEC-9,
R-CLUSTER-1, R-TOOL-8, R-COMPACT-8)."""

from __future__ import annotations

import math
from pathlib import Path

import trio

from greenroom.actors.runtime.compactor import _summary_in_a_record
from greenroom.actors.runtime.supervisor import SupervisorMessage
from greenroom.actors.runtime.tool_pool import ToolPool
from greenroom.protocols.content import ImageBlock, TextBlock, ToolCallBlock
from greenroom.protocols.trace import input_size


async def _no_sync() -> None:
    pass


async def test_a_tool_results_text_crowded_by_its_images_names_the_records_bytes(
    tmp_path: Path,
) -> None:
    """R-TOOL-8, R-SEC-9: a tool's result of a long text and a few images, within the
    result budget, does not fit one record of 4,000 bytes: its images are kept and its text
    cut to what they leave. The text's marker named that room (under 4,000 bytes); it
    names the record's 4,000 bytes now, as the images' own line does."""
    # Never read: the result is only fitted, no call runs in the pool.
    inbox, _ = trio.open_memory_channel[SupervisorMessage](math.inf)
    pool = ToolPool(
        tools={},
        inbox=inbox,
        workspace_dir=tmp_path,
        scratchpad_dir=tmp_path,
        sync_trace=_no_sync,
        result_budget=1_000_000,
        largest_record=4000,
    )
    images = tuple(
        ImageBlock(path=f"shot-{i}.png", media_type="image/png", sha256="0" * 64) for i in range(3)
    )
    call = ToolCallBlock(id="c1", name="shoot", arguments={})
    fitted = await pool._fit(call, (TextBlock(text="x" * 10_000), *images))
    assert fitted[1:] == images
    assert input_size(fitted) <= 4000
    text = fitted[0]
    assert isinstance(text, TextBlock)
    whole = tmp_path / "tool-output-c1.txt"
    assert text.text.endswith(f"trace (4000 bytes); the whole text is in {whole}]")
    assert whole.read_text() == "x" * 10_000


def test_a_summary_cut_beside_the_input_it_keeps_names_the_records_bytes() -> None:
    """R-COMPACT-8, R-SEC-9: a compaction summary larger than one record of 4,000 bytes is
    cut to the room the kept input leaves it in its ``compaction_end``. Its marker named
    that room; it names the record's 4,000 bytes now."""
    kept = (TextBlock(text="y" * 1000),)
    summary = _summary_in_a_record("z" * 10_000, kept, None, 4000)
    assert summary.startswith("z" * 1000) and len(summary) < 4000
    assert summary.endswith("trace (4000 bytes); the rest is not kept]")
