"""`python -m benchmarks --failover --kill scheduler`'s summary of a trial (benchmarks/failover.py): times from the
kill, and the steps during the outage against those before it."""

from benchmarks.failover import MEET_AFTER, summarize


def test_a_scheduler_trial_reports_resume_barrier_declaration_and_the_outage_steps():
    before, outage = [0.04] * 30, [0.05] * MEET_AFTER
    result = {
        "rank": 0,
        "steps": before + outage + [0.04] * 10,
        "correct": True,
        "failovers": [],
        "lost": None,
        "resumes": [{"term": 2, "seconds": 0.6}],
        "barrier_at": 100.65,
        "declared_at": 100.66,
    }
    trial = {"killed_at": 100.0, "results": [result, result | {"rank": 1, "resumes": []}], "code": 0, "kill_at": 30}
    row = summarize("scheduler", trial)
    assert row["sums_exact"] and row["workers_resumed"] == "1/2" and row["resumed_ms"] == [600.0]
    assert row["barrier_passed_ms"] == [650.0, 650.0] and row["declaration_answered_ms"] == [660.0, 660.0]
    assert row["median_step_ms"] == 40.0 and row["outage_step_ms"] == 50.0 and row["outage_step_over_median"] == 1.25
