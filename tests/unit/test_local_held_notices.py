"""Local mode's ``spotjob status`` shows the cloud notices a run's agents hold (``heldNotices``) in
the words of ``kubectl spotjob status``: a line per notice in the detail, a HELD-FLUSH column in the
list where a run holds one, and the JSON. Before, local mode showed none anywhere. The run that
produces them (a real local-mode job whose agent holds a GCE maintenance) is in
tests/e2e/test_local_run.py."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from rich.console import Console, RenderableType

from orchestrator.cli_status import status_command
from orchestrator.held_notices import held_cell, held_text
from orchestrator.live import RunRecord, Snapshot, held, render_run_detail, render_run_list, render_snapshot
from orchestrator.model import HeldNotice, JobKey, JobStatus, Phase
from orchestrator.store import JsonFileJobStore


def notice(worker: str, flush_in: timedelta) -> HeldNotice:
    now = datetime.now(UTC).replace(microsecond=0)
    return HeldNotice(
        worker=worker,
        node="local-node-1",
        source="gcp",
        kind="maintenance",
        detail="maintenance-event TERMINATE_ON_HOST_MAINTENANCE",
        deadline=now + flush_in + timedelta(minutes=5),
        flush_at=now + flush_in,
        heard_at=now,
    )


def shown(renderable: RenderableType) -> str:
    console = Console(record=True, width=400)
    console.print(renderable)
    return console.export_text()


def record(name: str, status: JobStatus, *, driven: bool = True) -> RunRecord:
    return RunRecord(name=name, path=f"/runs/{name}", spec=None, status=status, controller_alive=driven)


def test_the_detail_and_the_list_say_a_held_notice_as_kubectl_spotjob_status_does() -> None:
    first, second = notice("r-0-1", timedelta(minutes=50)), notice("r-0-0", timedelta(minutes=55))
    status = JobStatus(phase=Phase.RUNNING, held_notices=[first, second])
    as_kubectl = [h.model_dump(mode="json") for h in (first, second)]
    now = datetime.now(UTC)

    detail = shown(render_run_detail(record("r", status)))
    lines = [line.strip() for line in detail.splitlines() if line.strip().startswith("held notice")]
    # Its minutes are counted at each call: the line is kubectl's but for them.
    assert [line.split(" (in ")[0] for line in lines] == [
        f"held notice  {held_text(h, now)}".split(" (in ")[0] for h in as_kubectl
    ]
    assert all("training goes on, the flush starts" in line for line in lines), lines

    table = shown(render_run_list([record("r", status), record("quiet", JobStatus(phase=Phase.RUNNING))]))
    header, holding, quiet = table.splitlines()[:3]
    assert "HELD-FLUSH" in header
    cell = held_cell(as_kubectl, now)
    assert cell.startswith("in ") and cell.endswith(" (+1)"), cell
    assert " (+1) " in holding and " (+1)" not in quiet

    panel = shown(render_snapshot(Snapshot("r", 1.0, status, 3, None, None, 0, 0)))  # spotjob run's live view
    assert panel.count("held notice") == 2 and "r-0-1 on local-node-1: gcp maintenance" in panel, panel


def test_no_held_notice_is_shown_for_a_run_that_holds_none_ended_or_lost_its_driver() -> None:
    """Pins what already held for runs without notices (no column, no line); an ended run's or an
    undriven run's notices (their agents are gone) are not shown."""
    holding = [notice("r-0-0", timedelta(minutes=50))]
    for status, driven in (
        (JobStatus(phase=Phase.RUNNING), True),
        (JobStatus(phase=Phase.SUCCEEDED, held_notices=holding), True),
        (JobStatus(phase=Phase.RUNNING, held_notices=holding), False),
    ):
        r = record("r", status, driven=driven)
        assert "held notice" not in shown(render_run_detail(r))
        assert "HELD-FLUSH" not in shown(render_run_list([r]))
    assert held(JobStatus(phase=Phase.FAILED, held_notices=holding)) == []


def test_spotjob_status_json_carries_held_notices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Pins behaviour that already worked: the JSON is the stored status, heldNotices with it."""
    from orchestrator.model import CheckpointSpec, JobSpec

    key = JobKey.local("held")
    store = JsonFileJobStore(str(tmp_path / "held"), fsync=False)
    spec = JobSpec(command=["train.py"], checkpoint=CheckpointSpec(uri=str(tmp_path / "ckpt")))
    stored = store.create(key, spec)
    h = notice("held-0-0", timedelta(minutes=50))
    store.update_status(key, JobStatus(phase=Phase.RUNNING, held_notices=[h]), version=stored.version)
    assert status_command(argparse.Namespace(name="held", runs_dir=str(tmp_path), json=True)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"]["heldNotices"] == [h.model_dump(mode="json")]
