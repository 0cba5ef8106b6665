"""The engine core shared by every backend: what a backend executes (plan), what a policy sees (snapshot), how a
decision changes the state (apply), the loop that alternates them, and identical decode runs replayed as one
event (repeat)."""

from batchgen.engine.apply import apply_decision, record_outcome
from batchgen.engine.loop import Engine, Liveness, RunOutput, StepRecord, check_supported
from batchgen.engine.plan import (FFN_SCHEDULES, Backend, StepObserver, StepPlan, StepResult, filled,
                                  finished_ids)
from batchgen.engine.snapshot import InstanceProgress, make_snapshot

__all__ = ["FFN_SCHEDULES", "Backend", "Engine", "InstanceProgress", "Liveness", "RunOutput", "StepObserver",
           "StepPlan", "StepRecord", "StepResult", "apply_decision", "check_supported", "filled", "finished_ids",
           "make_snapshot", "record_outcome"]
