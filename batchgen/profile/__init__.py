"""Profiler: times each module of the executor's model on this device over a grid of shapes and writes a
calibration file, which `batchgen.latency.TablePredictor` interpolates and `batchgen.calibrate` fits.

    python -m batchgen.profile model=tiny_moe backend.device=cpu backend.threads=1 [grid=quick|full]
        [backend.dtype=float32] [out=calibration-cpu-tiny_moe.json] [hardware=cpu_epyc_milan_2c]
"""
from batchgen.profile.run import ProfileSettings, profile

__all__ = ["ProfileSettings", "profile"]
