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
    assert line.startswith("step 3/10") and "samples 64" in line
    assert "blocks" not in line and "[9, 13]" not in line


def test_piped_output_is_one_line_a_record_and_errors_go_to_stderr(capsys):
    """Not a terminal: no 80-column wrap, no progress line a report (the step lines say it), errors on stderr."""
    out = io.StringIO()
    events = Events(json_mode=False, stream=out)
    for _ in range(8):
        events.emit("progress", step=3, total_steps=10, loss=0.5, samples_per_second=10.0, peers=2, eta_s=5.0)
    events.emit("snapshot", step=3, where="/a/very/long/path/" + "x" * 120 + "@3", seconds=0.1)
    events.emit("error", code=2, message="bad flag")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("snapshot:") and "x" * 120 + "@3 " in lines[0]
    assert "bad flag" in capsys.readouterr().err


def test_a_piped_table_is_tab_separated_lines_one_a_row():
    """`node status` and `node runs` piped: no box, no wrap, a header line, then one line a row."""
    out = io.StringIO()
    events = Events(json_mode=False, stream=out)
    long = "y" * 150
    events.table("run r: step 3/10", ("peer", "step", "where"), [("a1", "3", long), ("b2", "2", "-")])
    assert out.getvalue().splitlines() == ["run r: step 3/10", "peer\tstep\twhere", f"a1\t3\t{long}", "b2\t2\t-"]
    out.truncate(0), out.seek(0)
    events.table("", ("run_id", "state"), [])
    assert out.getvalue() == "run_id\tstate\n"
