"""Batch jobs as users run them: an OpenAI batch file in, a results file out, resumable, one error per bad line,
and an estimate of the completion time before any model is loaded (`python -m batchgen.run`)."""
