"""What a peer prints: a step's block ranges go to machines (--json) only."""

import io
import json

from swarmrun.node.output import Events

STEP = dict(step=3, total_steps=10, loss=0.5, samples=64, blocks=[[0, 4], [9, 13]], cursor={"blocks_applied": 8})


def test_json_events_carry_a_steps_blocks_and_human_lines_leave_them_out():
    out = io.StringIO()
    Events(json_mode=True, stream=out).emit("step", **STEP)
    event = json.loads(out.getvalue())
    assert event["event"] == "step" and event["blocks"] == [[0, 4], [9, 13]]

    out = io.StringIO()
    Events(json_mode=False, stream=out).emit("step", **STEP)
    line = out.getvalue()
    assert line.startswith("step: step=3") and "samples=64" in line
    assert "blocks=" not in line and "[9, 13]" not in line
