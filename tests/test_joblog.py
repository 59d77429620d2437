"""A job's log keeps its earlier attempts although Snakemake deletes the log before each attempt."""
from __future__ import annotations

from pathlib import Path

from fedcore.runtime.joblog import open_job_log


def _attempt(log: Path, history: Path, lines: list[str], end: str = "\n") -> None:
    """One attempt of a job as Snakemake runs it: its log deleted first, then the script's own lines."""
    log.unlink(missing_ok=True)
    stream = open_job_log(log, history)
    for line in lines:
        stream.write(line + "\n")
    stream.write("progress 3/3" + end)
    stream.close()


def test_a_resumed_job_appends_to_the_log_of_its_earlier_attempts(tmp_path):
    log, history = tmp_path / "logs" / "seed0.log", tmp_path / "run" / "attempts.log"
    log.parent.mkdir()
    _attempt(log, history, ["round 1 done"], end="")  # killed mid-line
    _attempt(log, history, ["resuming from round 1 of 3"])
    _attempt(log, history, ["resuming from round 3 of 3"])
    text = log.read_text()
    order = ["round 1 done", "progress 3/3\n===== ", "attempt 2 of this job; the log above is from the earlier "
             "attempts =====", "resuming from round 1 of 3", "attempt 3 of this job", "resuming from round 3 of 3"]
    positions = [text.index(s) for s in order]
    assert positions == sorted(positions), text
    assert text.count("round 1 done") == 1 and text.count("=====\n") == 2
    assert history.read_text() == text  # the history holds the same lines, for the next attempt


def test_without_history_the_log_is_only_appended(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("kept\n")
    stream = open_job_log(log)
    stream.write("new\n")
    stream.close()
    assert log.read_text() == "kept\nnew\n"
    assert not list(tmp_path.glob("*attempts*"))
