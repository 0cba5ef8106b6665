"""The profiler's warm decode points: a call timed right after another call of the same layer's attention."""
import torch

from batchgen.exec.models import ExecModelConfig, init_random
from batchgen.profile.cases import Bench, WarmCase, attention_cases
from batchgen.profile.grid import GRIDS
from batchgen.profile.timing import Clock
from batchgen.specs.catalog import load_model


def test_warm_decode_points_are_profiled_beside_the_cold_ones():
    model = init_random(ExecModelConfig.from_spec(load_model("tiny_moe")), seed=0, dtype=torch.float32).eval()
    cases = attention_cases(Bench(model, 16), GRIDS["test"], 4096)
    warm = [c for c in cases if isinstance(c, WarmCase)]
    cold = {(c.point["tokens"], c.point["max_context"]) for c in cases
            if c.module == "attention_decode" and not c.point.get("warm") and c.point["micro_batches"] == 1}
    assert warm and all(c.point["warm"] and (c.point["tokens"], c.point["max_context"]) in cold for c in warm)
    seconds = warm[-1].measure(Clock(torch.device("cpu")), warmup=1, calls=2)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
