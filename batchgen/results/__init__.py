"""Results of a finished run: headline metrics, files on disk, a comparison table and a timeline plot; a
sweep's runs as sweep.csv, a figure and a grouped table (summarize_sweep)."""

from batchgen.results.metrics import device_table, step_arrays, summarize
from batchgen.results.plot import TimelinePlot, plot_timeline
from batchgen.results.summary import explain, format_table
from batchgen.results.sweep import summarize_sweep
from batchgen.results.writer import write_results

__all__ = ["TimelinePlot", "device_table", "explain", "format_table", "plot_timeline", "step_arrays", "summarize",
           "summarize_sweep", "write_results"]
