"""Calibration: fit the latency model's efficiency factors to measured timings.

Inputs are the executor's own calibration files (`modules`) and Vidur's published GPU operator profiles
(`vidur`); `gemm_fit` holds the fits, `check` compares a fitted GPU model with a profile, and
`python -m batchgen.calibrate` writes an efficiency file (conf/efficiency/<name>.yaml).
"""
