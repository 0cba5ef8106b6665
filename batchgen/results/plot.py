"""A run's timeline: how its GPUs' time split into compute, communication and idle, when it prefilled, and how
its running set drained. The title names the policy, model, cluster, workload and request count, so that the
figure stands alone; seconds are printed plainly (never 1e+03).

Step records can number 100K+, so each per-instance series is resampled onto a fixed grid of time bins as an
exact time-weighted average (the integral of a step function, read at the bin edges), not by plotting every
record: the figure costs the same for any run length and short prefill steps are never dropped.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchgen.results.forked import Deferred
from batchgen.results.metrics import StepArrays, bct, step_arrays, where_it_ran

BINS = 1000           # two points per bin with step drawing: ~2000 points per line
TITLE_CHARS = 150     # a title's line at most: wider runs off an 11-inch figure at 10 points
MAX_LINES = 8         # more instances than this are drawn as one aggregate line with a min-max band


def _binned_mean(start: np.ndarray, end: np.ndarray, value: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Time-weighted mean of a piecewise-constant signal (value on [start, end), 0 elsewhere) per bin."""
    order = np.argsort(start, kind="stable")
    start, end, value = start[order], end[order], value[order]
    area = np.cumsum(value * (end - start))
    xp = np.column_stack([start, end]).ravel()
    fp = np.column_stack([area - value * (end - start), area]).ravel()
    integral = np.interp(edges, xp, fp, left=0.0, right=float(area[-1]) if area.size else 0.0)
    return np.diff(integral) / np.diff(edges)


def _instance_series(s: StepArrays, edges: np.ndarray, num_instances: int) -> dict[str, np.ndarray]:
    """(instances x bins) compute share, communication share, prefill share and running sequences."""
    ranks = max(s.busy.shape[1], 1)
    per_s = ranks * np.maximum(s.duration, 1e-300)
    util = np.where(s.duration > 0, s.busy.sum(axis=1) / per_s, 0.0)
    comm = np.where(s.duration > 0, s.comm.sum(axis=1) / per_s, 0.0)
    prefill = (s.phase == "prefill").astype(float)
    series = {k: np.zeros((num_instances, edges.size - 1)) for k in ("util", "comm", "prefill", "running")}
    for inst in range(num_instances):
        m = s.instance == inst
        if m.any():
            for key, val in (("util", util[m]), ("comm", comm[m]), ("prefill", prefill[m]),
                             ("running", s.running[m].astype(float))):
                series[key][inst] = _binned_mean(s.start[m], s.end[m], val, edges)
    return series


def _step(ax, edges: np.ndarray, y: np.ndarray, **kw):
    return ax.step(edges, np.append(y, y[-1]), where="post", **kw)


def _draw_utilisation(ax, edges: np.ndarray, series: dict[str, np.ndarray], unit: str) -> None:
    """Compute, communication and idle stacked (the mean over every instance), the prefill share as a line and,
    for a few instances, each one's compute share."""
    util, comm = series["util"].mean(axis=0), series["comm"].mean(axis=0)
    busy = np.minimum(util + comm, 1.0)

    def ext(y: np.ndarray) -> np.ndarray:
        return np.append(y, y[-1])

    ax.fill_between(edges, 0, ext(util), step="post", color="tab:blue", alpha=0.55, linewidth=0, label="compute")
    ax.fill_between(edges, ext(util), ext(busy), step="post", color="tab:red", alpha=0.55, linewidth=0,
                    label="communication")
    ax.fill_between(edges, ext(busy), 1.0, step="post", color="0.85", linewidth=0, label="idle")
    if 1 < series["util"].shape[0] <= MAX_LINES:
        for inst, row in enumerate(series["util"]):
            _step(ax, edges, row, linewidth=0.8, label=f"instance {inst} compute")
    _step(ax, edges, series["prefill"].mean(axis=0), color="tab:orange", linestyle="--", linewidth=1,
          label="prefill (share of instance-time)")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel(f"share of {unit} time")
    ax.legend(loc="lower left", fontsize=7, ncol=4)


def _draw_running(ax, edges: np.ndarray, running: np.ndarray, finish: np.ndarray, clock: str) -> None:
    if running.shape[0] <= MAX_LINES:
        for inst, row in enumerate(running):
            _step(ax, edges, row, linewidth=1, label=f"instance {inst}")
    else:
        _step(ax, edges, running.sum(axis=0), color="tab:blue", linewidth=1,
              label=f"all {running.shape[0]} instances")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("running sequences")
    ax.set_xlabel(f"{clock} time (s)")
    twin = ax.twinx()
    done = np.searchsorted(np.sort(finish), edges, side="right") / max(finish.size, 1)
    twin.plot(edges, done, color="black", linestyle="--", linewidth=1, label="finished (cumulative)")
    twin.set_ylim(0, 1.02)
    twin.set_ylabel("share of sequences finished")
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="upper right", fontsize=7, ncol=2)


@dataclass
class Timeline:
    """What the figure draws: a few arrays of `BINS` values and the finish times, not the run's records, so
    that a process which never saw the run (`TimelinePlot`'s) can draw it."""

    edges: np.ndarray
    series: dict[str, np.ndarray]   # instances x bins: util, comm, prefill, running
    finish: np.ndarray              # finished sequences' finish times
    title: str
    measured: bool                  # by an executor, or simulated


def timeline_of(out) -> Timeline:
    s = step_arrays(out)
    horizon = max(bct(out), float(s.end.max(initial=0.0)), 1e-9)
    edges = np.linspace(0.0, horizon, BINS + 1)
    finish = out.prepared.state.table.finish_time
    return Timeline(edges, _instance_series(s, edges, out.prepared.state.topo.num_instances),
                    finish[~np.isnan(finish)], title(out), out.backend in ("exec", "dist"))


def plot_timeline(out, path: Path) -> Path:
    """Write timeline.png (see `timeline_figure`)."""
    return _save(timeline_of(out), Path(path))


class TimelinePlot:
    """timeline.png drawn in a forked process (batchgen.results.forked), started before the run: matplotlib is
    imported there while the run goes on, and the figure drawn while the caller writes its other files."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._child = Deferred(_import_pyplot, lambda t: _save(t, self.path), f"drawing {self.path}")

    def draw(self, out) -> None:
        self._child.send(timeline_of(out))

    def wait(self) -> Path:
        self._child.wait()
        return self.path

    def cancel(self) -> None:
        self._child.cancel()


def _import_pyplot() -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401 - imported ahead of the figure


def _save(t: Timeline, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig = draw_timeline(t)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline_figure(out):
    """The timeline as a matplotlib Figure: GPU time as compute, communication and idle above, the running set
    and the share finished below."""
    return draw_timeline(timeline_of(out))


def draw_timeline(t: Timeline):
    _import_pyplot()
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 6.5))
    _draw_utilisation(top, t.edges, t.series, "rank" if t.measured else "GPU")
    _draw_running(bottom, t.edges, t.series["running"], t.finish, "measured" if t.measured else "simulated")
    bottom.set_xlim(0, t.edges[-1])
    plain_seconds(bottom.xaxis)
    plain_seconds(bottom.yaxis)
    heading = textwrap.wrap(t.title, TITLE_CHARS)
    fig.suptitle("\n".join(heading), fontsize=10)
    # margins sized from what they hold (the running count's digits, the title's lines): a layout engine
    # (constrained, or a tight bounding box) measures every label in a second pass, half of the figure's time
    digits = len(f"{bottom.get_ylim()[1]:.0f}")
    fig.subplots_adjust(left=0.045 + 0.0068 * digits, right=0.93, top=0.935 - 0.03 * (len(heading) - 1),
                        bottom=0.085, hspace=0.06)
    return fig


def title(out) -> str:
    """What ran where: policy, model, cluster, workload and request count, and its BCT."""
    job = out.job
    measured = out.backend in ("exec", "dist")
    return (f"{job.policy.name} | {job.model.name} | {where_it_ran(out)[0]} | {job.workload.name}, "
            f"{len(out.prepared.state.table):,} requests | {'measured' if measured else 'simulated'} "
            f"BCT {bct(out):,.1f} s")


def plain_seconds(axis) -> None:
    """Tick labels as plain numbers (1120, never 1.12e+03 or an offset)."""
    from matplotlib.ticker import ScalarFormatter

    formatter = ScalarFormatter(useOffset=False)
    formatter.set_scientific(False)
    axis.set_major_formatter(formatter)
