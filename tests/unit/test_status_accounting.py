"""`node status` shows the run's data accounting (the human table's footer and the --json fields)."""

import argparse
import io
import json

from swarmrun.node.cli import status as status_mod
from swarmrun.node.output import Events


def fake_status(accounting):
    async def gather(run_id, peers, **kw):
        return dict(run_id=run_id, task="synthetic", spec_hash="ab" * 32, providers=[], total_steps=10, target_batch_size=64,
                    step=4, samples_per_second=12.5, finished=False, **accounting,
                    peers=[dict(peer_id="Qm" + "x" * 20, role="trainer", step=4, samples=8, samples_per_second=12.5,
                                state_hash="cd" * 32, age_s=0.3, finished=False)])
    return gather


def run(monkeypatch, accounting, json_mode):
    monkeypatch.setattr(status_mod, "gather_status", fake_status(accounting))
    out = io.StringIO()
    args = argparse.Namespace(run_id="my-run", peers=["/ip4/127.0.0.1/tcp/1/p2p/QmNpSjxgnFHiqSVUVmiQywnsqJJXQuoCB1Ek7HxavvcTx4"],
                              state_dir=None, json=json_mode)
    assert status_mod.run_status(args, Events(json_mode=json_mode, stream=out)) == 0
    return out.getvalue()


def test_status_reports_blocks(monkeypatch):
    accounting = dict(blocks_applied=70, blocks_pending=26, blocks_skipped=0, blocks_duplicated=0, data_epoch=1)
    human = " ".join(run(monkeypatch, accounting, json_mode=False).split())  # rich wraps long lines
    assert "data: epoch 1, 70 blocks applied, 26 pending in this epoch, 0 skipped, 0 duplicated" in human
    line = json.loads(run(monkeypatch, accounting, json_mode=True))
    assert {k: line[k] for k in accounting} == accounting
    unknown = dict.fromkeys(accounting)  # no peer reports a cursor (an older version)
    assert "no peer reports its cursor" in run(monkeypatch, unknown, json_mode=False)
