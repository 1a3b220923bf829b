"""The job's deadline (training/deadline.py): where it comes from and when it stops a run. The stop itself, in a
real training run with a fake clock, is tests/test_nothing_lost.py::test_a_run_saves_and_stops_before_its_deadline."""

from __future__ import annotations

from datetime import datetime

from megatron_upipe.training import deadline
from megatron_upipe.training.deadline import MARGIN_S, SAVE_ESTIMATE_S, Deadline, job_deadline, slurm_end_time


def test_the_slurm_end_time_comes_from_the_environment_else_squeue():
    assert slurm_end_time({"SLURM_JOB_END_TIME": "1767225600", "SLURM_JOB_ID": "7"}, squeue=None) == 1767225600.0
    asked = []

    def squeue(job):
        asked.append(job)
        return "2026-12-06T22:31:00\n"

    end = slurm_end_time({"SLURM_JOB_ID": "42"}, squeue=squeue)
    assert asked == ["42"] and end == datetime(2026, 12, 6, 22, 31).timestamp()
    for no_limit in ("N/A\n", "Unknown", "", None):
        assert slurm_end_time({"SLURM_JOB_ID": "42"}, squeue=lambda job, v=no_limit: v) is None
    assert slurm_end_time({}, squeue=lambda job: "2026-12-06T22:31:00") is None  # not under Slurm


def test_the_deadline_is_the_earliest_of_the_setting_and_slurm():
    env = {"SLURM_JOB_END_TIME": str(10_000)}
    assert job_deadline(None, 0.0, env) == 10_000
    assert job_deadline(60.0, 0.0, env) == 3_600  # exit_duration_mins first
    assert job_deadline(600.0, 0.0, env) == 10_000  # the Slurm limit first
    assert job_deadline(None, 0.0, {}) is None


def test_a_step_that_cannot_finish_and_save_in_time_is_not_started():
    d = Deadline(at=10_000.0)
    assert not d.must_stop(9_999.0)  # no step measured or predicted: run the first one
    d.step_s.append(1_000.0)
    assert not d.must_stop(10_000.0 - 1_000.0 - SAVE_ESTIMATE_S - MARGIN_S)
    assert d.must_stop(10_000.0 - 1_000.0 - SAVE_ESTIMATE_S - MARGIN_S + 1)
    d.save_s.append(10.0)  # a measured save replaces the allowance
    assert not d.must_stop(10_000.0 - 1_000.0 - 10.0 - MARGIN_S)
    d.step_s.append(2_000.0)  # the longest step measured
    assert d.must_stop(10_000.0 - 1_000.0 - 10.0 - MARGIN_S)


def test_a_limit_shorter_than_one_predicted_step_is_refused_at_start():
    d = Deadline(at=5.2 * 3600, predicted_step_s=9.0 * 3600)
    line = d.start_refusal(0.0)
    assert line.startswith("the job's time limit leaves 5.20 h but one step takes about 9.00 h (the step-time model)")
    assert "sbatch --time" in line and "\n" not in line
    assert Deadline(at=10 * 3600, predicted_step_s=9.0 * 3600).start_refusal(0.0) is None
    assert Deadline(at=1.0).start_refusal(0.0) is None  # nothing predicted: nothing to refuse
    assert deadline.hours(5400) == "1.50 h"
